"""docs/attention-model.md, executed: its package is copied out of the page and pip-installed;
the model, built from the installed attention and MLP layer types, trains under tp 2 with
sequence parallelism x pp 2 (the tied embedding on both end stages), and under zbv's V-shape
placement, with the single-process
losses and grad norms within relative 1e-5 (fp32), through the kit's own
``assert_layouts_match``. The plugin stays under 100 lines of code."""

from __future__ import annotations

import importlib
import os
import pathlib
import sys

import pytest
from plugtron.testing import DistributedPool, assert_layouts_match

from tests.doc_packages import doc_files, install_doc_package

DOC = pathlib.Path(__file__).parents[2] / "docs" / "attention-model.md"
FLAGS = {"model": "tinygpt", "num-layers": 4, "num-attention-heads": 4}


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    root = tmp_path_factory.mktemp("tinygpt")
    package, site = root / "plugtron-tinygpt", root / "site"
    install_doc_package(DOC, package, site)
    old_path = os.environ.get("PYTHONPATH")
    # The pool's ranks are new interpreters: they find the package through PYTHONPATH.
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), *([old_path] if old_path else [])])
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    yield site
    sys.path.remove(str(site))
    if old_path is None:
        os.environ.pop("PYTHONPATH")
    else:
        os.environ["PYTHONPATH"] = old_path
    sys.modules.pop("tinygpt", None)
    importlib.invalidate_caches()


def test_the_page_has_the_package_and_the_plugin_is_short():
    files = doc_files(DOC.read_text())
    assert set(files) == {"pyproject.toml", "tinygpt.py"}
    code = [line for line in files["tinygpt.py"].splitlines()
            if line.strip() and not line.strip().startswith("#")]
    assert len(code) < 100, len(code)


def test_sequence_parallel_and_the_tied_embedding_match_one_process(installed):
    with DistributedPool(4, timeout=300) as pool:  # started after the install
        # One layout holds all three: the SP blocks, pp's stage split and the tied copies. The
        # page's model calls chunk_layers without a placement: under zbv's V the builder's
        # placement still gives each chunk its stage's layers (both tied copies on rank 0).
        assert_layouts_match(FLAGS, layouts=[{"tp": 2, "sequence-parallel": True, "pp": 2},
                                             {"pp": 2, "schedule": "zbv"}], pool=pool)
