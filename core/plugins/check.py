"""``plugtron plugins check``: import installed plugins and hold their hooks against the specs.

pluggy is lenient where a plugin author needs it strict: a hook implementation whose name is no
hookspec is accepted and never called, a ``plugtron_*`` method without ``@hookimpl`` is silently
ignored, and a parameter the spec does not have only fails when the run registers the plugin,
as a traceback. This check finds those before a run, without registering or instantiating
anything: it imports each entry point and reads the object it names (a class, its inherited
methods included, a module or an instance). Each problem is one line that names the plugin, its
distribution and the hook. Warnings are lines for what works but is incomplete (a layer type
without ``activation_bytes``, whose activations the memory estimate counts as 0); they do not
fail the check.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Collection
from dataclasses import dataclass

from plugtron.core.contracts import hookspecs, versions
from plugtron.core.errors import PluginError
from plugtron.core.plugins import registry
from plugtron.core.plugins.selection import DRIVER_ROLES

#: Model transforms: pluggy plugins for their transform hooks; their options, selection and
#: checks the core calls on the class itself (as for layer types), marked or not.
TRANSFORM_ROLE = "model_transform"
CALLED_ON_THE_CLASS = ("plugtron_config_sections", "plugtron_select", "plugtron_validate")
#: Roles whose plugins are pluggy plugins; the others (layers, backends, ...) are only imported.
HOOK_ROLES = (*DRIVER_ROLES, "extension", TRANSFORM_ROLE)


@dataclass(frozen=True)
class Problem:
    plugin: registry.PluginInfo
    hook: str | None  # None: the plugin as a whole (it does not import, ...)
    message: str
    warning: bool = False  # works, but something is missing: reported, never fails the check

    def __str__(self) -> str:
        where = f"{self.plugin.role} {self.plugin.name!r} ({self.plugin.origin})"
        hook = f" hook {self.hook!r}" if self.hook else ""
        return f"{'warning: ' if self.warning else ''}{where}{hook}: {self.message}"


@dataclass(frozen=True)
class HookSpec:
    name: str
    params: tuple[str, ...]
    historic: bool
    role: str | None  # the driver role it belongs to; None for lifecycle hooks
    required: bool  # a contract hook: the driver of ``role`` must implement it


def hook_specs() -> dict[str, HookSpec]:
    marker = f"{hookspecs.PROJECT_NAME}_spec"
    specs = {}
    for name, fn in vars(hookspecs).items():
        opts = getattr(fn, marker, None)
        if opts is None or not inspect.isfunction(fn):
            continue
        role = (hookspecs.CONTRACT_HOOKS.get(name) or hookspecs.OPTIONAL_DRIVER_HOOKS.get(name)
                or hookspecs.TRANSFORM_HOOKS.get(name))
        specs[name] = HookSpec(name, tuple(inspect.signature(fn).parameters),
                               bool(opts.get("historic")), role,
                               name in hookspecs.CONTRACT_HOOKS or name in hookspecs.TRANSFORM_HOOKS)
    return specs


@dataclass(frozen=True)
class Method:
    """One routine of a plugin object that pluggy would look at."""

    attribute: str
    hook: str  # the hook it implements: ``specname`` when the marker gives one
    function: object
    impl: dict | None  # the @hookimpl options; None when it is not marked
    params: tuple[tuple[str, bool], ...]  # (name, has a default), bound argument left out


def _params(obj, attribute: str, function) -> tuple[tuple[str, bool], ...]:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return ()
    params = [p for p in signature.parameters.values()
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    # A plain function read from a class is unbound: pluggy calls it on an instance.
    if (inspect.isclass(obj) and inspect.isfunction(function) and params
            and not isinstance(inspect.getattr_static(obj, attribute), staticmethod)):
        params = params[1:]
    return tuple((p.name, p.default is not p.empty) for p in params)


def plugin_methods(obj) -> list[Method]:
    marker = f"{hookspecs.PROJECT_NAME}_impl"
    methods = []
    for attribute in dir(obj):
        if attribute.startswith("__"):
            continue
        try:
            function = getattr(obj, attribute)
        except Exception:  # a property or descriptor that fails on the class: not a hook
            continue
        if not inspect.isroutine(function):
            continue
        impl = getattr(function, marker, None)
        impl = impl if isinstance(impl, dict) else None
        hook = (impl or {}).get("specname") or attribute
        methods.append(Method(attribute, hook, function, impl,
                              _params(obj, attribute, function)))
    return methods


def _closest(name: str, specs: dict[str, HookSpec]) -> str:
    match = difflib.get_close_matches(name, specs, n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else ""


def check_hooks(info: registry.PluginInfo, obj) -> list[Problem]:
    """The hook problems of one imported plugin object of a pluggy role."""
    specs = hook_specs()
    problems = []

    def problem(hook, message):
        problems.append(Problem(info, hook, message))

    methods = plugin_methods(obj)
    implemented = set()
    for method in methods:
        spec = specs.get(method.hook)
        if spec is None:
            if method.impl is not None or method.hook.startswith(f"{hookspecs.PROJECT_NAME}_"):
                problem(method.hook, f"is not a plugtron hook, so nothing calls it"
                                     f"{_closest(method.hook, specs)}")
            continue
        if method.impl is None:
            if info.role == TRANSFORM_ROLE and spec.name in CALLED_ON_THE_CLASS:
                continue
            if spec.role is None:  # contract-named helpers are reported as missing below
                problem(spec.name, "is not marked @hookimpl, so pluggy never calls it")
            continue
        wrapper = bool(method.impl.get("wrapper") or method.impl.get("hookwrapper"))
        if not wrapper:
            implemented.add(spec.name)
        extra = [(name, default) for name, default in method.params if name not in spec.params]
        for name, default in extra:
            never = " (it has a default, so it is never passed)" if default else ""
            problem(spec.name, f"parameter {name!r} is not in the hookspec{never}; the hook "
                               f"has: {', '.join(spec.params)}")
        if wrapper and not inspect.isgeneratorfunction(method.function):
            problem(spec.name, "is a wrapper but not a generator function: it must `yield`")
        if wrapper and spec.historic:
            problem(spec.name, "is historic, and historic hooks cannot be wrapped")
        if not wrapper and spec.role is not None and spec.role != info.role:
            problem(spec.name, f"belongs to the {spec.role} driver; any other plugin may only "
                               f"wrap it (@hookimpl(wrapper=True)), else a run has two "
                               f"implementations")

    if info.role in (*DRIVER_ROLES, TRANSFORM_ROLE):
        defined = {m.hook for m in methods}
        for spec in specs.values():
            if spec.required and spec.role == info.role and spec.name not in implemented:
                hint = (" (a method of that name exists but is not marked @hookimpl)"
                        if spec.name in defined else "")
                problem(spec.name, f"not implemented: every {info.role} driver must implement "
                                   f"it{hint}")
    return problems


def check_plugin(info: registry.PluginInfo) -> list[Problem]:
    """Import one plugin and, for pluggy roles, check its hooks."""
    missing = registry.unmet_requirements(info)
    if missing:
        return [Problem(info, None, f"its distribution needs {', '.join(missing)}, which is "
                                    f"not installed")]
    try:
        obj = registry.load_entry_point(info)
    except PluginError as exc:
        cause = exc.__cause__ or exc
        return [Problem(info, None, f"failed to import ({info.value}): "
                                    f"{type(cause).__name__}: {cause}")]
    deprecations = [Problem(info, None, f"deprecated: {message}", warning=True)
                    for message in versions.uses_in(info.value.split(":")[0])]
    return deprecations + _check_loaded(info, obj)


def _check_loaded(info: registry.PluginInfo, obj) -> list[Problem]:
    if info.role == "layer":
        return check_layer_type(info, obj)
    if info.role == "converter":
        return check_converter(info, obj)
    if info.role not in HOOK_ROLES:
        return []
    return check_hooks(info, obj)


def check_layer_type(info: registry.PluginInfo, obj) -> list[Problem]:
    """A layer type that cannot say what it keeps for backward is counted as keeping nothing by
    ``plugtron estimate`` and train's memory check, so a run that will not fit can pass it."""
    if callable(getattr(obj, "activation_bytes", None)):
        return []
    return [Problem(info, "activation_bytes", "not defined: plugtron estimate and train's memory "
                    "check count this layer's activations as 0; define "
                    "activation_bytes(shape) -> int (docs/plugins/layers.md) and hold it to "
                    "autograd with plugtron.testing.assert_activation_bytes_match",
                    warning=True)]


def check_converter(info: registry.PluginInfo, obj) -> list[Problem]:
    """A converter's optional parts (``--drop PART`` on export): ``droppable_parts`` must say
    what each is, and ``drop_part`` must be there to leave it out."""
    parts = getattr(obj, "droppable_parts", None)
    if parts is None:
        return []
    if not isinstance(parts, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                              for k, v in parts.items()):
        return [Problem(info, "droppable_parts", "must be a dict {part: what it is} of strings "
                        "(docs/interchange.md#export)")]
    if not callable(getattr(obj, "drop_part", None)):
        return [Problem(info, "drop_part", f"not defined: droppable_parts offers "
                        f"{', '.join(parts)}, but export --drop needs drop_part(config, part) "
                        f"to leave one out (docs/interchange.md#export)")]
    return []


def installed_plugins(names: Collection[str] = ()) -> list[registry.PluginInfo]:
    """Every installed plugin, role by role (``registry.roles()`` order) then by name; only those
    called one of ``names`` when given."""
    return [info for role in registry.roles() for info in registry.available(role)
            if not names or info.name in names]


def check_plugins(infos: list[registry.PluginInfo]) -> list[tuple[registry.PluginInfo,
                                                                   list[Problem]]]:
    """Each plugin with its problems (empty: it passed)."""
    origins: dict[tuple[str, str], list[str]] = {}
    for other in installed_plugins():
        origins.setdefault((other.role, other.name), []).append(other.origin)
    results = []
    for info in infos:
        problems = []
        same_name = origins.get((info.role, info.name), [])
        if len(same_name) > 1:
            problems.append(Problem(info, None, f"the name is registered by more than one "
                                                f"distribution ({', '.join(same_name)}); runs "
                                                f"cannot select it until all but one are "
                                                f"uninstalled"))
        results.append((info, problems + check_plugin(info)))
    return results
