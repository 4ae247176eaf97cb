"""agoq.vocabulary is the one definition of the words the stages share: the plan's Literal types, the choices of
`agoq train` and `agoq search`, the readers of profiles and search requests, and the runtime's layout rules all
take their words from it, and no module of agoq spells one of its word lists out again."""

import argparse
import ast
import sys
import typing
from pathlib import Path

import pytest

import agoq
from agoq import vocabulary as v

AGOQ = Path(agoq.__file__).parent
GROUPS = ("GRADIENT_MODES", "OPTIMIZERS", "MASTERS", "COMPILE_MODES", "TORCH_COMPILE_MODES", "LAYOUTS",
          "PARALLEL_MODES")


def _literal(model, field: str) -> tuple:
    return typing.get_args(model.model_fields[field].annotation)


def test_the_plans_literal_types_are_the_vocabulary():
    from agoq.formats.plan import Alternative, GradientsSpec, OptimizerSpec, TrainingSpec

    assert _literal(GradientsSpec, "mode") == v.GRADIENT_MODES
    assert _literal(OptimizerSpec, "name") == v.OPTIMIZERS
    assert _literal(OptimizerSpec, "master") == v.MASTERS
    assert _literal(TrainingSpec, "compile") == v.COMPILE_MODES
    assert _literal(Alternative, "compile") == v.COMPILE_MODES


def _choices(argv: list[str]) -> dict[str, tuple]:
    """Each option of the sub-command's parser -> its choices (None: free)."""
    from agoq.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[argv[0]]
    return {a.option_strings[-1]: tuple(a.choices) if a.choices is not None else None
            for a in sub._actions if a.option_strings}


def _search_words(option: str) -> tuple:
    """The words `agoq search`'s option reads (a request field: its own rule, agoq.search.request)."""
    from agoq.search.request import BadField, read_field

    words = []
    for word in ("any", *{w for g in GROUPS for w in getattr(v, g)}):
        try:
            read_field(option.lstrip("-").replace("-", "_"), word)
        except BadField:
            continue
        words.append(word)
    return tuple(sorted(words))


def test_the_commands_choices_are_the_vocabulary():
    train = _choices(["train"])
    assert train["--gradients"] == v.GRADIENT_MODES
    assert train["--optimizer"] == v.OPTIMIZERS
    assert train["--master"] == v.MASTERS
    assert train["--parallel"] == v.PARALLEL_MODES
    assert train["--weight-gather"] == v.WEIGHT_GATHERS
    assert train["--compile-mode"] == v.TRAIN_TORCH_COMPILE_MODES
    assert set(v.TRAIN_TORCH_COMPILE_MODES) <= set(v.TORCH_COMPILE_MODES)
    from agoq.search import request

    assert request.GRADIENTS == ("any", *v.GRADIENT_MODES) and request.LAYOUTS == ("any", *v.LAYOUTS)
    assert request.OPTIMIZERS == ("any", *v.OPTIMIZERS) and request.COMPILE_MODES == ("any", *v.COMPILE_MODES)
    assert set(request.MASTERS) == {"any", *v.MASTERS}
    for option, words in (("--gradients", v.GRADIENT_MODES), ("--layout", v.LAYOUTS), ("--optimizer", v.OPTIMIZERS),
                          ("--master", v.MASTERS), ("--compile", v.COMPILE_MODES)):
        assert _search_words(option) == tuple(sorted(("any", *words))), option


def test_the_readers_take_the_vocabulary():
    from agoq.formats import measured_steps
    from agoq.layout import MODES, ParallelLayout
    from agoq.runtime.optim import state_bytes
    from agoq.search.layouts import LAYOUT_GRADIENTS, LAYOUTS
    from agoq.search.state import GRADIENT_MODES
    from agoq.train import config

    assert MODES == v.PARALLEL_MODES and LAYOUTS == v.LAYOUTS and GRADIENT_MODES == v.GRADIENT_MODES
    assert LAYOUT_GRADIENTS is v.LAYOUT_GRADIENTS
    assert (config.OPTIMIZERS, config.MASTERS, config.PARALLEL_MODES) == (v.OPTIMIZERS, v.MASTERS, v.PARALLEL_MODES)
    assert (state_bytes.OPTIMIZERS, state_bytes.MASTERS) == (v.OPTIMIZERS, v.MASTERS)
    assert (measured_steps.COMPILE_MODES, measured_steps.OPTIMIZERS) == (v.COMPILE_MODES, v.OPTIMIZERS)
    for mode in v.PARALLEL_MODES:  # the runtime runs what the vocabulary says each mode runs
        world = 1 if mode == v.NONE else 2
        layout = ParallelLayout.of(mode, world, node_size=1 if mode == v.HSDP else None)  # hsdp: 2 nodes of 1
        for gradients in v.GRADIENT_MODES:
            runs = True
            try:
                layout.check_gradients(gradients)
            except ValueError:
                runs = False
            assert runs == (gradients in v.MODE_GRADIENTS[mode]), (mode, gradients)


def test_layouts_and_parallel_modes_map_both_ways():
    """A plan of each layout launches in a parallel mode that runs that layout; every mode's layout is one."""
    for layout in v.LAYOUTS:
        for processes in (1, 2, 8):
            mode = v.parallel_mode(layout, 1, processes)
            assert v.PARALLEL_LAYOUT[mode] == layout
            assert (mode == v.NONE) == (processes == 1 and layout == v.REPLICATED)
        assert v.parallel_mode(layout, 4, 4) == v.PIPELINE
    assert set(v.PARALLEL_LAYOUT) == set(v.PARALLEL_MODES) and set(v.PARALLEL_LAYOUT.values()) == set(v.LAYOUTS)
    assert v.search_layout(None) is None and v.search_layout(v.PIPELINE) is None
    assert [v.search_layout(m) for m in (v.NONE, v.DDP, v.FSDP, v.HSDP)] == \
        [v.REPLICATED, v.REPLICATED, v.FSDP, v.HSDP]
    # agoq's retired own sharded path: no layout or mode of it, and asking for one says what to run instead
    assert v.SHARDED not in v.LAYOUTS + v.PARALLEL_MODES and v.search_layout(v.SHARDED) is None
    with pytest.raises(ValueError, match="retired.*--parallel fsdp --gradients sdp4bit --weight-gather int4"):
        v.parallel_mode(v.SHARDED, 1, 2)
    for layout, gradients in v.LAYOUT_GRADIENTS.items():  # a layout is priced only with what its modes run
        modes = [m for m, lay in v.PARALLEL_LAYOUT.items() if lay == layout]
        assert all(any(g in v.MODE_GRADIENTS[m] for m in modes) for g in gradients), layout


def _word_lists(path: Path):
    """(line, words) of each tuple, list or set literal of two or more strings in the file."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) >= 2 and \
                all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
            yield node.lineno, {e.value for e in node.elts}


def test_no_module_spells_a_word_list_out_again(tmp_path):
    """A literal tuple (list, set) of two or more words of one vocabulary list, anywhere in agoq but
    agoq/vocabulary.py, is a second definition: it must import the words instead."""
    groups = {name: set(getattr(v, name)) for name in GROUPS}
    found = []
    for path in sorted(AGOQ.rglob("*.py")):
        if path.name == "vocabulary.py" and path.parent == AGOQ:
            continue
        for line, words in _word_lists(path):
            found += [f"{path.relative_to(AGOQ.parent)}:{line}: {sorted(words)} (agoq.vocabulary.{name})"
                      for name, group in groups.items() if words <= group]
    assert not found, "\n".join(found)
    # the check finds what it looks for
    probe = tmp_path / "probe.py"
    probe.write_text('MODES = ("bf16", "quangrad8")\nX = {"eager", "compiled"}\nY = ("bf16", "fp32")\n')
    assert [words for _, words in _word_lists(probe)] == [{"bf16", "quangrad8"}, {"eager", "compiled"},
                                                          {"bf16", "fp32"}]
    assert [words <= set(v.GRADIENT_MODES) for _, words in _word_lists(probe)] == [True, False, False]


def test_the_vocabulary_imports_nothing_heavy():
    import subprocess

    code = ("import sys; import agoq.vocabulary; "
            "print(sorted(m for m in ('torch', 'numpy', 'pydantic') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
