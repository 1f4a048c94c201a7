"""What each notebook promises in its text adds up: the title's points and minutes are the sums
of its exercises' (the core's, and a challenge part's where a notebook has one), and every exercise
header's points are the points of its graded cells; code lines fit the cell; the link to Colab
reads offline; a "section N" is a section of the notebook; and the sentences that state what
PyTorch or Triton do say what the installed versions do."""

from __future__ import annotations

import re

import nbformat
import pytest

from autograder.publishing import release
from tests.conftest import ASSIGNMENTS

TITLE_TOTALS = re.compile(r"\*\*(?P<points>\d+) points, about (?P<minutes>\d+) minutes\.\*\*")
EXERCISE = re.compile(r"^#{2,4}\s+Exercise\s+(?P<number>\d+\.\d+)\b(?P<rest>.*)$", re.MULTILINE)
HEADER_POINTS = re.compile(r"\((?P<points>\d+) pts?\b")
HEADER_MINUTES = re.compile(r"~(?P<minutes>\d+) min\b")
# A part for the few, with its own totals in the title: every exercise after this heading belongs to it.
CHALLENGE_HEADING = re.compile(r"^#{2,3}\s+(\d+\.\s+)?Challenge\b", re.MULTILINE)


def _exercises(assignment: str) -> list[dict]:
    """Each exercise header in order, with the points of the graded cells that follow it, and whether it is
    in the notebook's challenge part."""
    notebook = release.build_source(assignment, release.course_repository())
    exercises: list[dict] = []
    challenge = False
    for cell in notebook.cells:
        nbgrader = cell.metadata.get("nbgrader", {})
        if cell.cell_type == "markdown":
            challenge = challenge or bool(CHALLENGE_HEADING.search(cell.source))
            for match in EXERCISE.finditer(cell.source):
                points, minutes = HEADER_POINTS.search(match["rest"]), HEADER_MINUTES.search(match["rest"])
                assert points and minutes, f"{assignment}: header of exercise {match['number']} should say " \
                                           f"'(N pts, ~M min)': {match.group(0)!r}"
                exercises.append({"number": match["number"], "points": int(points["points"]),
                                  "minutes": int(minutes["minutes"]), "graded": 0.0, "challenge": challenge})
        if nbgrader.get("grade"):
            assert exercises, f"{assignment}: graded cell {nbgrader['grade_id']} comes before any exercise header"
            exercises[-1]["graded"] += nbgrader["points"]
    return exercises


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_each_exercise_header_gives_the_points_of_its_graded_cells(assignment):
    exercises = _exercises(assignment)
    assert exercises, f"{assignment} has no exercise"
    wrong = [f"Exercise {e['number']}: header says {e['points']}, graded cells give {e['graded']:g}"
             for e in exercises if e["points"] != e["graded"]]
    assert not wrong, f"{assignment}: " + "; ".join(wrong)


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_title_gives_the_total_points_and_minutes_of_the_exercises(assignment):
    """'**P points, about M minutes.**' for the core; a notebook with a challenge part gives its totals too."""
    title = release.build_source(assignment, release.course_repository()).cells[0].source
    found = [(int(match["points"]), int(match["minutes"])) for match in TITLE_TOTALS.finditer(title)]
    assert found, f"{assignment}: the title cell should say '**P points, about M minutes.**'"
    exercises = _exercises(assignment)
    parts = [[e for e in exercises if not e["challenge"]], [e for e in exercises if e["challenge"]]]
    expected = [(sum(e["graded"] for e in part), sum(e["minutes"] for e in part)) for part in parts if part]
    assert found == expected, \
        f"{assignment}: the title says (points, minutes) {found}; the exercises add up to {expected} " \
        "(the core, then the challenge part if there is one)"
    if parts[1]:
        assert "challenge part" in title, f"{assignment}: the title should name the challenge part its totals count"


# Code lines a student reads without scrolling sideways (JupyterLab at a laptop's width).
MAX_CODE_LINE = 100


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_no_code_line_of_a_released_notebook_is_wider_than_the_cell(assignment):
    notebook = nbformat.read(release.released_notebook(assignment), as_version=4)
    long_lines = [f"cell {index} ({cell.get('id')}): {len(line)} chars: {line[:60]}..."
                  for index, cell in enumerate(notebook.cells) if cell.cell_type == "code"
                  for line in cell.source.splitlines() if len(line) > MAX_CODE_LINE]
    assert not long_lines, f"{assignment}: {len(long_lines)} code line(s) over {MAX_CODE_LINE} characters:\n" \
                           + "\n".join(long_lines[:10])


def test_the_colab_link_is_text_that_reads_offline():
    """The title's link to Colab is not an image fetched from the network."""
    for assignment in ASSIGNMENTS:
        title = nbformat.read(release.released_notebook(assignment), as_version=4).cells[0].source
        assert "colab.research.google.com/github/" in title, f"{assignment}: no link to Colab in the title"
        assert "![" not in title and "<img" not in title, f"{assignment}: the title shows an image: {title[-200:]}"


# Names a student's answer may import or define for itself: a demo or check cell that rebinds one breaks a
# later exercise, blamed on the wrong answer (issue #34: 03 bound `stack = Transformer(...)`, and an answer that
# did `from torch import stack` then failed in sinusoidal_positions' exercise). Imports that bind a name to the
# library's own object (`import numpy as np`, `from torch import stack`) are harmless and allowed.
LIBRARY_NAMES = frozenset({
    "stack", "cat", "concat", "concatenate", "einsum", "softmax", "log_softmax", "mask", "F", "np", "torch", "nn",
    "math", "einops", "rearrange", "repeat", "reduce", "plt", "tl", "triton", "functools", "partial", "sqrt", "exp",
    "log", "tensor", "Tensor", "zeros", "ones", "full", "empty", "arange", "rand", "randn", "matmul", "where", "tril",
    "triu", "masked_fill", "linear", "dropout", "relu", "gelu", "layer_norm", "scaled_dot_product_attention",
    "chunk", "split", "transpose", "permute",
})


def _global_bindings(source: str) -> list[tuple[str, int]]:
    """(name, line) of every module-level name a cell binds by assignment, loop, with, def or class -- not by
    import, and not inside a function, class body, lambda or comprehension (their names are local)."""
    import ast

    local_scopes = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda, ast.ListComp, ast.SetComp,
                    ast.DictComp, ast.GeneratorExp)
    tree = ast.parse("\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines()))
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.append((child.name, child.lineno))
            elif isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
                found.append((child.id, child.lineno))
            if not isinstance(child, local_scopes):
                visit(child)

    visit(tree)
    return found


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_no_cell_but_an_answer_binds_a_name_a_student_imports(assignment):
    import builtins

    notebook = nbformat.read(release.released_notebook(assignment), as_version=4)
    clobbered = [f"cell {index}, line {line}: {name}" for index, cell in enumerate(notebook.cells)
                 if cell.cell_type == "code" and not cell.metadata.get("nbgrader", {}).get("solution")
                 for name, line in _global_bindings(cell.source)
                 if name in LIBRARY_NAMES or hasattr(builtins, name)]
    assert not clobbered, f"{assignment}: a cell that is not an answer binds a global a student may import or " \
                          "use (give it a name of its own):\n" + "\n".join(clobbered)


def test_the_global_binding_scan_sees_assignments_loops_and_definitions_but_not_local_names():
    source = ("stack = 1\nfor mask, other in []:\n    pass\nwith open('x') as F:\n    pass\ndef cat():\n    einsum = 2\n"
              "total = [softmax for softmax in range(3)]\nimport numpy as np\nfrom torch import stack as stack\n"
              "%matplotlib inline\n")
    assert [name for name, _ in _global_bindings(source)] == ["stack", "mask", "other", "F", "cat", "total"]


# What a check expects, written as the phrases that would give it away. A student reads every
# cell of a released notebook (a closing summary, the cell under a check, a test cell's docstring,
# a demo's code) before answering, so none may contain them; an answer's explanation goes into the
# check's success message instead (tests/test_checks_<module>.py shows it appears only once the
# answer is right).
ANSWER_PHRASES: dict[str, dict[str, tuple[str, ...]]] = {
    "01_mha_shapes": {
        "attention_layer_flops": ("8·B·S·D²", "4·B·S²·D"),
        "ANSWER_ATTENTION_CROSSOVER": ("4,608", "4608", "6·D", "S > 2·D", "2·D:", "1536", "1,536"),
        "block_flops": ("16·B·S·D²", "4·B·S·D·hidden"),
    },
    "02_numpy_walkthrough": {
        "np_attention_backward": ("Pᵀ @ dout", "dS @ K", "dSᵀ @ Q", "softmax_backward(P, dout @ Vᵀ)"),
        "derive_delta": ("dout_i · out_i", "rowsum(dout ∘ out)", "Σ_c dout_ic · out_ic"),
    },
    "03_positions_and_blocks": {
        "ANSWER_PERMUTATION": ("says where a token sits", "only shuffles the output rows"),
        "ANSWER_NO_POSITIONS": ("1/(S - 1) = 1/7", "right with probability", "The ceiling.", "beats 1/(S-1)"),
        "ANSWER_NOPE_CAUSAL": ("most recent one it can see", "can find the previous token"),
        "what_one_head_does": ("puts almost all its weight", "previous-token head), stays", "clean previous-token",
                               "does **recency**", "recency is not tied", "no step at 8"),
    },
    "04_vision_transformer": {
        "why_vit_needs_positions": ("nothing tells patch 3 from patch 12",),
    },
    "06_efficient_attention": {
        "ANSWER_BACKWARD_FLOPS": ("2.5×", "3.5×", "2.5x", "3.5x", "five products", "seven products"),
    },
}


def _cells_giving_answers(notebook: nbformat.NotebookNode, phrases: dict[str, tuple[str, ...]]) -> list:
    return [f"cell {index} ({cell.cell_type}): {phrase!r} gives away {answer}"
            for index, cell in enumerate(notebook.cells)
            for answer, answer_phrases in phrases.items() for phrase in answer_phrases if phrase in cell.source]


@pytest.mark.parametrize("assignment", sorted(ANSWER_PHRASES))
def test_no_released_cell_gives_away_an_answer(assignment):
    notebook = nbformat.read(release.released_notebook(assignment), as_version=4)
    answers = {cell.metadata.get("nbgrader", {}).get("grade_id") for cell in notebook.cells}
    unknown = set(ANSWER_PHRASES[assignment]) - answers
    assert not unknown, f"{assignment} has no answer cell {sorted(unknown)}: update ANSWER_PHRASES"
    leaks = _cells_giving_answers(notebook, ANSWER_PHRASES[assignment])
    assert not leaks, f"{assignment}: " + "; ".join(leaks)


# --------------------------------------------------------------------------------------
# Cross-references: a "section N" exists, and says what the sentence needs of it
# --------------------------------------------------------------------------------------

SECTION_HEADING = re.compile(r"^##\s+(?P<number>\d+)\.\s+(?P<title>.+)$", re.MULTILINE)
SECTION_MENTION = re.compile(r"\b[Ss]ections? (?P<number>\d+)\b")

# (a sentence's words around its section number, a word the title of that section must contain): a
# reorder or a new section that leaves a sentence pointing at the wrong place fails here.
SECTION_MEANINGS: dict[str, tuple[tuple[str, str], ...]] = {
    "05_llama_attention": (
        (r"a quarter of the K/V memory \(section (\d+)\)", "size of the KV cache"),
        (r"Go through section (\d+) again", "KV cache"),
    ),
    "06_efficient_attention": (
        (r"as Triton kernels, section (\d+)", "Challenge"),
        (r"merged \(section (\d+)\)", "merging"),
        (r"Section (\d+) builds a design without atomics", "Challenge"),
        (r"section (\d+) adds your Triton kernel", "Triton kernel"),
        (r"the reason section (\d+) gave", "fused kernel is faster"),
        (r"\*\*FlashAttention-2's\*\* \(section (\d+)\)", "backward pass"),
        (r"from section (\d+)'s formulas", "backward pass"),
        (r"core ends\s+with section (\d+)", "Triton kernel"),
    ),
}


def _markdown_text(assignment: str) -> tuple[str, dict[int, str]]:
    """The released notebook's markdown (comment marks gone, lines joined) and its sections' titles by number."""
    notebook = nbformat.read(release.released_notebook(assignment), as_version=4)
    markdown = "\n".join(cell.source for cell in notebook.cells if cell.cell_type == "markdown")
    titles = {int(match["number"]): match["title"] for match in SECTION_HEADING.finditer(markdown)}
    return re.sub(r"\s+", " ", markdown), titles


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_every_section_a_notebook_mentions_is_one_of_its_sections(assignment):
    text, titles = _markdown_text(assignment)
    missing = sorted({int(m["number"]) for m in SECTION_MENTION.finditer(text)} - set(titles))
    assert not missing, f"{assignment} mentions section(s) {missing}; its sections are {sorted(titles)}"


@pytest.mark.parametrize("assignment", sorted(SECTION_MEANINGS))
def test_a_section_mentioned_for_its_content_is_the_section_with_that_content(assignment):
    text, titles = _markdown_text(assignment)
    for sentence, title_word in SECTION_MEANINGS[assignment]:
        found = re.findall(sentence, text)
        assert found, f"{assignment}: no sentence matches {sentence!r} (update SECTION_MEANINGS)"
        for number in found:
            assert title_word in titles.get(int(number), ""), \
                f"{assignment}: {sentence!r} points at section {number}, {titles.get(int(number))!r}, which is " \
                f"not about {title_word!r}"


# --------------------------------------------------------------------------------------
# Sentences about what PyTorch and Triton do, against the installed versions
# --------------------------------------------------------------------------------------

def _last_row(module, x, blocked, need_weights):
    row = module(x, x, x, attn_mask=blocked, need_weights=need_weights)[0][0, -1]
    return "NaN" if bool(row.isnan().any()) else "zeros" if bool((row == 0).all()) else "other"


def test_01_says_what_nn_multiheadattention_does_with_a_row_that_sees_no_key():
    """01's fast-path paragraph: the conditions it lists decide the fast path (NaN), need_weights does not, and
    off the fast path need_weights=True gives NaN (its own softmax) where need_weights=False gives zeros."""
    import torch
    from torch import nn

    text, _ = _markdown_text("01_mha_shapes")
    for condition in ("eval mode", "no autograd", "`batch_first=True`", "the same tensor as query, key and value",
                      "no `kdim`/`vdim`", "`bias=True`", "a boolean mask or none", "an **even number of heads**",
                      "`need_weights` is *not* one of the conditions"):
        assert condition in text, f"01 no longer says {condition!r}: check the paragraph against PyTorch again"
    torch.manual_seed(0)
    seq_len = 5
    blocked = torch.zeros(seq_len, seq_len, dtype=torch.bool)
    blocked[-1] = True  # the last query may attend to nothing
    as_floats = torch.zeros(seq_len, seq_len).masked_fill(blocked, float("-inf"))

    def row(need_weights, training=False, autograd=False, embed_dim=16, num_heads=4, mask=blocked, **options):
        module = nn.MultiheadAttention(embed_dim, num_heads, batch_first=True, **options).train(training)
        x = torch.randn(1, seq_len, embed_dim)
        with torch.set_grad_enabled(autograd):
            return _last_row(module, x, mask, need_weights)

    assert row(False) == row(True) == "NaN"                          # the fast path, whatever need_weights says
    assert row(False, training=True) == row(False, autograd=True) == "zeros"  # off it: SDPA's zeros ...
    assert row(True, training=True) == row(True, autograd=True) == "NaN"      # ... or its own softmax's NaN
    assert row(False, bias=False) == "zeros"                          # bias=False leaves the fast path
    assert row(False, mask=as_floats) == "zeros"                      # so does a float mask
    assert row(False, num_heads=1) == row(False, embed_dim=12, num_heads=3) == "zeros"  # odd heads too
    assert row(False, embed_dim=12, num_heads=4) == "NaN"             # embed_dim does not decide it


def test_06_says_what_tl_dot_needs_on_an_nvidia_gpu_as_the_installed_triton_does():
    """06 and the launchers: the reduction dimension K >= 16 (>= 32 for 8-bit), M and N free (Triton's own table)."""
    compiler = pytest.importorskip("triton.backends.nvidia.compiler")
    language = pytest.importorskip("triton.language")
    check = compiler.min_dot_size(None)
    sixteen_bit = language.block_type(language.float16, [16, 16])
    eight_bit = language.block_type(language.float8e4nv, [16, 16])
    assert check(sixteen_bit, sixteen_bit) == (1, 1, 16) and check(eight_bit, eight_bit) == (1, 1, 32)
    text, _ = _markdown_text("06_efficient_attention")
    assert "to be at least 16 (32 for 8-bit inputs; `M` and `N` may be smaller)" in text
    from attention_lab import triton_kernels

    assert triton_kernels.MIN_BLOCK == 16


def test_06_quotes_the_tiled_pass_intensity_over_the_sequence_lengths_it_prints():
    """'114 at S = 1k to 127 at 16k', and 'from 0.3× an H100 PCIe's (at 1k) to 0.8× an A100's (at 16k)'."""
    from attention_lab.widgets.efficient_attention import attention_traffic

    def intensity(seq_len):
        flops, moved = attention_traffic(seq_len, head_dim=64, bytes_per_element=2, block_q=128)["tiled"]
        return flops / moved

    assert (round(intensity(1024)), round(intensity(16384))) == (114, 127)
    assert (round(intensity(1024) / (756 / 2.0), 1), round(intensity(16384) / (312 / 2.0), 1)) == (0.3, 0.8)
    text, _ = _markdown_text("06_efficient_attention")
    assert "114 at `S = 1k` to 127 at 16k" in text and "from 0.3× an H100 PCIe's (at `S = 1k`) to 0.8× an A100's" in text
