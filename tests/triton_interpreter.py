"""Patch triton.language once per interpreted launch, not once per device-function call.

Under ``TRITON_INTERPRET=1`` every call of a ``@triton.jit`` helper from inside a kernel runs
``triton.runtime.interpreter._patch_lang`` again: it walks ``triton.language`` with
``inspect.getmembers`` to re-install, over the launch's own patches, the same interpreted builtins,
and the scope it returns is never restored (the launch's ``restore()`` puts the originals back). Our
kernels call thousands of helpers per launch, so that walk was about a third of the Triton cases'
time in the suite. :func:`install` skips it when the launch in progress has already patched every
``triton.language`` module the helper can see; a helper that sees one more (``tl.zeros`` sees
``triton.language.core``) is patched as before. The interpreted arithmetic is untouched: the same
patched builtins compute the same values.

Installed by ``tests/conftest.py`` and by the distributed tests' ranks; a Triton whose interpreter
lacks these internals is left as it is.
"""
import inspect


def install() -> None:
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    if getattr(interpreter, "_patched_once_per_launch", False):
        return
    if not (callable(getattr(interpreter, "_patch_lang", None)) and hasattr(interpreter, "_LangPatchScope")):
        return
    patch_lang = interpreter._patch_lang
    languages = (tl, tl.core)
    seen: dict[int, frozenset] = {}  # id(fn.__globals__) -> the language modules it names
    launches: list[set] = []  # per launch in progress: the language modules patched for it

    def languages_of(fn) -> frozenset:
        key = id(fn.__globals__)
        if key not in seen:
            seen[key] = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in languages)
        return seen[key]

    def patch_lang_once_per_launch(fn):
        wanted = languages_of(fn)
        if launches:  # a device-function call inside a launch (its scope is never restored)
            if wanted <= launches[-1]:
                return interpreter._LangPatchScope()
            launches[-1] |= wanted
            return patch_lang(fn)
        scope = patch_lang(fn)  # a launch: GridExecutor restores this scope when the grid is done
        launches.append(set(wanted))
        restore = scope.restore

        def restore_and_end_launch():
            launches.pop()
            restore()

        scope.restore = restore_and_end_launch
        return scope

    interpreter._patch_lang = patch_lang_once_per_launch
    interpreter._patched_once_per_launch = True
