"""``bench/code_counts.py`` on a small synthetic tree: each count sees exactly what its rule says."""
import json
from pathlib import Path

from helpers import load_bench_script

ROOT = Path(__file__).resolve().parents[1]


def _load():
    return load_bench_script("code_counts")


def _body(lines: int) -> str:
    """A function body that makes the whole ``def`` exactly ``lines`` lines long."""
    return "".join(f"    x{i} = {i}\n" for i in range(lines - 2)) + "    return 0\n"


FILES = {
    "taps_kernels/backend.py": (
        "PREFERENCES: dict = {\n    'foo': Preference(('cpp',), 'why'),\n    'bar': Preference((), 'why'),\n}\n"
        "def resolve(op, backend, device):\n    return op\n"
        "def placement():\n    return resolve('foo', None, 'cpu')\n"),  # the dispatcher: never a door
    "taps_kernels/__init__.py": "from .ops import (foo, bar, baz)\nfrom .layout import foo_layout\n",
    "taps_kernels/ops/foo.py": (
        "def foo(x):\n    return resolve('foo', None, x)[1](x)\n"  # door 1 (name and dispatch, once)
        "def bar(x):\n    return x\n"),  # door of bar by name
    "taps_kernels/custom.py": (
        "import torch\n"
        "@torch.library.custom_op('taps::foo', mutates_args=())\n"
        "def foo_op(x):\n    return x\n"  # door 2 (custom op)
        "def foo(x):\n    return foo_op(x)\n"  # door 3 (named foo)
        "def caller(x):\n    return foo(x)\n"  # reaches foo through a door: not one
        "class Holder:\n    def bar(self):\n        return 0\n"),  # a method of the same name: not a door
    "taps_kernels/reference/foo.py": "def foo(x):\n    return x\n",  # the spec: not a door
    "taps_kernels/cpp_impls.py": "def foo(x):\n    return resolve('foo', 'cpp', x)\n",  # registers only
    "taps_kernels/triton/k.py": (
        "import triton\n"
        "@triton.jit\ndef _kernel(" + ", ".join(f"a{i}" for i in range(20)) + "):\n" + _body(150)
        + "@triton.jit(do_not_specialize=['a'])\ndef _kernel2(a):\n" + _body(120)),
    "python/taps/decode/fast.py": (
        "class Loop:\n"
        "    def step(self, d):\n        return _impl('foo', d)\n"  # door 4 (a method dispatching itself)
        "    def other(self, d):\n        return resolve(OP, None, d)\n"  # not a literal: not counted
        "def user():\n    import taps_kernels\n    return taps_kernels.foo(1)\n"),
    "python/taps/paths.py": (
        "import os\n"
        "def cache_root():\n    return os.getenv('TAPS_CACHE', '~')\n"  # the one definition (its read is in it)
        "def elsewhere():\n    return os.environ.get('TAPS_CACHE')\n"  # a second definition
        "ROOT = os.environ['TAPS_CACHE']\n"  # a third, at module level
        "OTHER = os.environ.get('TAPS_HOME')\n"),  # another variable: no
    "python/taps/long.py": (
        "def exactly_100():\n" + _body(100)
        + "def over_100():\n" + _body(101)
        + "class Outer:\n    def method(self):\n" + "".join("    " + ln + "\n" for ln in _body(102).splitlines())
        + "def twelve(" + ", ".join(f"a{i}" for i in range(12)) + "):\n    return 0\n"
        + "def thirteen(a, b, *args, c, d, e, f, g, h, i, j, k, **kw):\n    return 0\n"
        + "class Wide:\n    def m(self, " + ", ".join(f"a{i}" for i in range(12)) + "):\n        return 0\n"),
    "python/taps/decode/policies/p.py": (
        "def tree_size(log_reach, latency, plain_s):\n    return 0\n"  # a size rule, named below
        "def pool_size(n):\n    return n\n"  # no latency table: not a size rule
        "def build():\n    return tree_size(1, 2, 3)\n"),
    "python/taps/scoring/replay.py": (
        "from taps.decode.policies.p import tree_size\n"
        "def batch_sizes(log_reach, table):\n    return 0\n"),  # a second rule, named by no module
    "bench/b.py": "def main():\n" + _body(130),  # bench counts for length
    "tests/t.py": "def test_long():\n" + _body(300),  # tests are not read
}


def make_tree(root: Path) -> Path:
    for rel, text in FILES.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
    return root


def test_counts_follow_the_rules(tmp_path):
    cc = _load()
    c = cc.count(make_tree(tmp_path))
    off = c["offenders"]
    assert off["long_functions"] == ["python/taps/long.py:101 over_100 (101 lines)",
                                     "python/taps/long.py:203 Outer.method (102 lines)",
                                     "bench/b.py:1 main (130 lines)"]
    assert c["long_functions"] == 3
    assert [x.split(" ")[1] for x in off["many_parameters"]] == ["thirteen", "Wide.m"]
    assert c["many_parameters"] == 2
    assert off["cache_root_definitions"] == ["python/taps/paths.py:2 cache_root (def)",
                                             "python/taps/paths.py:5 elsewhere (reads TAPS_CACHE)",
                                             "python/taps/paths.py:6 <module> (reads TAPS_CACHE)"]
    assert c["cache_root_definitions"] == 3
    assert c["front_doors"] == {
        "foo": ["taps_kernels/custom.py:3 foo_op", "taps_kernels/custom.py:5 foo", "taps_kernels/ops/foo.py:1 foo",
                "python/taps/decode/fast.py:2 Loop.step"],
        "bar": ["taps_kernels/ops/foo.py:3 bar"],
        "baz": [],
    }
    assert c["front_doors_max"] == 4
    assert off["size_rules"] == [
        "python/taps/decode/policies/p.py:1 tree_size (named in python/taps/decode/policies/p.py, "
        "python/taps/scoring/replay.py)",
        "python/taps/scoring/replay.py:2 batch_sizes (named in no policy or trace-replay module)"]
    assert c["size_rules"] == 2


def test_main_prints_and_writes_json(tmp_path, capsys):
    cc = _load()
    out = tmp_path / "out" / "counts.json"
    assert cc.main(["--root", str(make_tree(tmp_path / "src")), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "functions over 100 lines (Triton kernels excluded): 3" in text
    assert "front doors per op (most: 4):" in text
    saved = json.loads(out.read_text())
    assert saved["long_functions"] == 3 and saved["front_doors_max"] == 4
    assert not any(str(tmp_path) in json.dumps(v) for v in saved.values())  # paths relative to the root


def test_the_checkout_parses():
    c = _load().count(ROOT)
    assert c["front_doors"]["tree_mask"] and c["cache_root_definitions"] >= 1


LIBRARY_FILES = {
    "taps_kernels/backend.py": "PREFERENCES: dict = {\n    'qux': Preference(('cpp',), 'why'),\n"
                               "    'quux': Preference(('cpp',), 'why'),\n}\n",
    "taps_kernels/__init__.py": "from .ops import (qux, quux)\n",
    "taps_kernels/ops/qux.py": (
        "def qux(x):\n    return qux_op(x)\n"  # the public op, through its library op: one door
        "def _qux_kernel(x):\n    return backend_for('qux', None, x)\n"
        "def _qux_fake(x):\n    return x\n"
        "qux_op = define('qux(Tensor x) -> Tensor', _qux_kernel, _qux_fake)\n"
        "def _quux_kernel(x):\n    return backend_for('quux', None, x)\n"  # defined, but no public quux calls it
        "quux_op = define('quux(Tensor x) -> Tensor', _quux_kernel, _qux_fake)\n"),
    "taps_kernels/reference/select.py": (
        "def _ratio_size(sorted_e, latency):\n    return 0\n"  # a helper of the spec below: part of it
        "def select_ratio_reference(x, latency):\n    return _ratio_size(x, latency)\n"
        "def select_joint_reference(x, table):\n    return 0\n"  # a second rule
        "def select_plain_reference(x, max_nodes):\n    return 0\n"),  # no table: not a size rule
}


def test_library_ops_and_reference_rules(tmp_path):
    for rel, text in LIBRARY_FILES.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
    c = _load().count(tmp_path)
    assert c["front_doors"] == {"qux": ["taps_kernels/ops/qux.py:1 qux (+ torch.ops.taps.qux)"],
                                "quux": ["taps_kernels/ops/qux.py:8 _quux_kernel"]}
    assert c["offenders"]["size_rules"] == [
        "taps_kernels/reference/select.py:3 select_ratio_reference (a reference: reached through select_subtree)",
        "taps_kernels/reference/select.py:5 select_joint_reference (a reference: reached through select_subtree)"]
