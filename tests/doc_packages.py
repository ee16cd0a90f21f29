"""Packages written out of a docs page: each ``<!-- file: NAME -->`` followed by a fenced block
is one file of the package (test_writing_plugins_doc, test_attention_model_doc,
test_plugin_new)."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

FILE_BLOCK = re.compile(r"<!-- file: (\S+) -->\n```\w*\n(.*?)```", re.S)


def doc_files(text: str) -> dict[str, str]:
    """``<!-- file: NAME -->`` followed by a fenced block: NAME -> its contents."""
    return dict(FILE_BLOCK.findall(text))


def install_doc_package(doc: pathlib.Path, package: pathlib.Path, site: pathlib.Path) -> None:
    """Write the page's files into ``package`` and pip-install it into ``site`` (``--target``:
    never into this venv)."""
    package.mkdir()
    for name, body in doc_files(doc.read_text()).items():
        (package / name).write_text(body)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(site), str(package)],
                   check=True, capture_output=True)
