"""The plumbing of ``python -m tritile bench --eager`` and ``--against tilekernels`` on the CPU: the eager timer's
rounds, the dotted-path resolver behind ``Case.impl``, TileKernels found (or refused: missing, the shim), its op run on
the case's own inputs with the same timers, the warm-up shards, the summaries and ``scripts/results_md.py --side``.
The timers are fakes here (a GPU run times for real); the cases' kernels run in the interpreter."""

from __future__ import annotations

import ast
import glob
import importlib.util
import inspect
import io
import json
import os
import sys
import types

import pytest
import torch

import tritile
from tritile.bench import _REGISTRY, TRITILE, BenchOp, Case, load_all, op, resolve, resolver
from tritile.bench.runner import make_cases, print_grid_tables, run, tk_summary
from tritile.bench.timing import time_eager

_ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


# ------------------------------------------------------------------------------------------------------- eager timer
class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_time_eager_rounds_and_calls():
    clock = _Clock()
    costs = iter([5e-6] * 2 + [4e-6] * 100 + [2e-6] * 100 + [3e-6] * 300)  # warm, estimate, then 5 rounds of 100

    def fn():
        clock.t += next(costs)

    syncs = []
    us, n = time_eager(fn, sync=lambda: syncs.append(clock.t), clock=clock)
    assert n == 100 and us == pytest.approx(2.0)  # the best round: 100 calls of 2 µs
    assert len(syncs) == 2 + 2 * 5  # after the warm call and the estimate; before and after each round


def test_time_eager_long_op_keeps_rounds_short():
    clock = _Clock()

    def fn():
        clock.t += 10e-3  # 10 ms a call: a 50 ms round holds 5 calls

    us, n = time_eager(fn, sync=lambda: None, clock=clock)
    assert n == 5 and us == pytest.approx(10e3)
    assert time_eager(lambda: None, calls=3, rounds=1, sync=lambda: None, clock=_Clock())[1] == 3
    for bad in (dict(calls=0), dict(rounds=0)):
        with pytest.raises(ValueError, match="calls and rounds must be >= 1"):
            time_eager(lambda: None, sync=lambda: None, **bad)


# ------------------------------------------------------------------------------------------------ resolver, op, Case
def test_resolve_paths():
    assert resolve("tritile", "quant.per_token_cast") is tritile.quant.per_token_cast
    from tritile.quant.per_token_cast_to_e5m6_kernel import per_token_cast_to_e5m6
    assert resolve("tritile", "quant.per_token_cast_to_e5m6_kernel.per_token_cast_to_e5m6") is per_token_cast_to_e5m6
    from tritile.modeling.mhc.ops import mhc_post
    assert resolver("tritile")("modeling.mhc.ops.mhc_post") is mhc_post
    for missing in ("quant.no_such_op", "no_such_module.op", "quant.per_token_cast.no_such_attr"):
        with pytest.raises(LookupError, match=f"tritile has no {missing}"):
            resolve("tritile", missing)


def test_op_and_case():
    x = torch.arange(6.0).reshape(2, 3)
    impl = op("transpose.transpose", x)
    assert impl.op_path == "transpose.transpose"
    case = Case(params={}, impl=impl)
    assert torch.equal(case.fn(), x.T)  # fn is impl(TRITILE)
    seen = []
    assert case.counterpart(lambda path: (lambda *a: seen.append((path, a)))) is not None
    assert Case(params={}, impl=impl, no_tk="why").counterpart(TRITILE) is None
    assert Case(params={}, fn=lambda: 1).counterpart(TRITILE) is None
    with pytest.raises(TypeError, match="needs fn or impl"):
        Case(params={"a": 1})


def _case_calls(path):
    """The ``Case(...)`` calls of a case file, as AST nodes."""
    tree = ast.parse(open(path).read())
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "Case"]


def test_every_case_names_a_tilekernels_call():
    """Every case of quant, moe, engram, transpose and mhc names its call by ``impl`` (so --against can run
    TileKernels' op), or says in ``no_tk`` why TileKernels has none; every op path a case file names exists in
    tritile (whose API and module layout are TileKernels')."""
    files = glob.glob(os.path.join(_ROOT, "tritile", "bench", "cases", "*.py"))
    seen = 0
    for path in files:
        for call in _case_calls(path):
            kws = {k.arg for k in call.keywords}
            assert "impl" in kws or "no_tk" in kws, f"{os.path.basename(path)}:{call.lineno}"
            seen += 1
        tree = ast.parse(open(path).read())
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and getattr(n.func, "id", None) in ("op", "get", "_fwd_bwd_impl") and n.args \
                    and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str):
                resolve("tritile", n.args[0].value)
    assert seen >= 40


@pytest.mark.parametrize("module", ["transpose", "moe", "mhc"])
def test_quick_cases_bind_their_ops(module):
    """Built cases: an ``op`` impl's arguments bind to the op's signature (the same names in TileKernels), and a
    factory resolves its ops through the package it is given."""
    cpu = torch.device("cpu")
    for bop in load_all([module]):
        for case in make_cases(bop, cpu, True):
            if case.impl is None:
                assert case.no_tk, (bop.op, case.params)
                continue
            paths = []
            fn = case.impl(lambda path: paths.append(path) or resolve("tritile", path))
            assert paths, (bop.op, case.params)
            if hasattr(case.impl, "op_path"):
                inspect.signature(resolve("tritile", case.impl.op_path)).bind(*fn.args, **fn.keywords)


# --------------------------------------------------------------------------------------------------- --against runs
def _fake_tilekernels(monkeypatch, shim=False, calls=None):
    """A ``tile_kernels`` package in ``sys.modules`` whose ``transpose`` ops wrap tritile's and count their calls."""
    calls = calls if calls is not None else []
    pkg = types.ModuleType("tile_kernels")
    pkg.__file__ = "/opt/TileKernels/tile_kernels/__init__.py"
    pkg.__path__ = []
    quant = tritile.quant if shim else types.ModuleType("tile_kernels.quant")
    tr = types.ModuleType("tile_kernels.transpose")

    def wrap(name):
        f = getattr(tritile.transpose, name)

        def tk_op(x):
            calls.append((name, x))
            return f(x)
        return tk_op

    tr.transpose, tr.batched_transpose = wrap("transpose"), wrap("batched_transpose")
    pkg.quant, pkg.transpose = quant, tr
    for name, mod in (("tile_kernels", pkg), ("tile_kernels.quant", quant), ("tile_kernels.transpose", tr)):
        monkeypatch.setitem(sys.modules, name, mod)
    resolve.cache_clear()
    return calls


class _FakeTimers:
    """Kernel µs 10 for tritile's call and 20 for TileKernels' (told apart by the fake's call log), eager 15 / 60."""

    def __init__(self, calls):
        self.calls = calls

    def _tk(self, fn):
        n = len(self.calls)
        fn()
        return len(self.calls) > n

    def copy_bandwidth(self):
        return 1000.0

    def events(self, fn, **kw):
        fn()
        return 12.0

    def graph(self, fn, **kw):
        fn()
        return 11.0

    def host(self, fn, **kw):
        fn()
        return 3.0

    def kernels(self, fn, **kw):
        return 20.0 if self._tk(fn) else 10.0

    def eager(self, fn, **kw):
        return (60.0 if self._tk(fn) else 15.0), 100


@pytest.fixture
def _clean_resolve():
    resolve.cache_clear()
    yield
    resolve.cache_clear()


def test_against_live_runs_tilekernels_on_the_same_inputs(monkeypatch, tmp_path, _clean_resolve):
    calls = _fake_tilekernels(monkeypatch)
    out = io.StringIO()
    js = tmp_path / "bench.json"
    rows = run(modules=["transpose"], quick=True, eager=True, against="tilekernels", timers=_FakeTimers(calls),
               json_path=str(js), out=out, tk_commit="abc1234")
    assert len(rows) == 3 and all(r["status"] == "ok" for r in rows)
    for r in rows:
        assert (r["cupti_us"], r["tk_us"], r["vs_tk"]) == (10.0, 20.0, 2.0)
        assert (r["eager_us"], r["tk_eager_us"], r["vs_tk_eager"], r["host_cost_us"]) == (15.0, 60.0, 4.0, 5.0)
        assert r["tk_source"] == "live" and r["eager_calls"] == 100
    # TileKernels' op got the case's own input tensor, of the case's shape
    shapes = {tuple(x.shape) for name, x in calls if name == "batched_transpose"}
    assert shapes == {(3, 64, 192)}
    meta = json.loads(js.read_text())["meta"]
    assert meta["tilekernels"]["source"] == "live" and meta["tilekernels"]["commit"] == "abc1234"
    assert meta["eager"] is True
    text = out.getvalue()
    assert "TileKernels run live" in text and "commit abc1234" in text
    assert "| TK eager µs | × TK eager |" in text
    assert "| × TK kernel: worst | at | geomean | × TK eager: worst | at | geomean |" in text
    assert "| transpose | 3 | 2.00 | 0 | 4.00 | 0 |" in text  # the module's geometric means and shapes below 1.0


def test_against_refuses_the_shim_and_a_missing_package(monkeypatch, _clean_resolve):
    calls = _fake_tilekernels(monkeypatch, shim=True)
    out = io.StringIO()
    rows = run(modules=["transpose"], quick=True, against="tilekernels", timers=_FakeTimers(calls), out=out,
               cupti_only=True)
    assert not calls and all("tk_us" not in r for r in rows)  # CPU cases have no recorded anchor
    assert "import shim onto tritile, not TileKernels" in out.getvalue()
    monkeypatch.setitem(sys.modules, "tile_kernels", None)  # import fails
    out = io.StringIO()
    run(modules=["transpose"], ops=["transpose"], quick=True, against="tilekernels", timers=_FakeTimers([]),
        out=out, cupti_only=True)
    assert "recorded H200 figures" in out.getvalue() and "tile_kernels is not importable" in out.getvalue()
    with pytest.raises(ValueError, match="against must be None or 'tilekernels'"):
        run(modules=["transpose"], against="liger")


@pytest.fixture
def _fake_op():
    """A registered op of module ``fake``: an op both packages have, one TileKernels lacks, one with ``no_tk``."""
    def cases(device, quick):
        x = torch.arange(4.0)
        yield Case(params=dict(kind="shared"), impl=op("utils.ceil_div", 7, 2))
        yield Case(params=dict(kind="missing"), impl=op("transpose.transpose", x.view(2, 2)))
        yield Case(params=dict(kind="other"), fn=lambda: x + 1, no_tk="another library's op")

    entry = BenchOp("fake", "fake_op", cases)
    _REGISTRY.append(entry)
    yield
    _REGISTRY.remove(entry)


def test_against_per_case_status(monkeypatch, _fake_op, _clean_resolve):
    calls = []
    pkg = types.ModuleType("tile_kernels")
    pkg.__file__, pkg.__path__ = "/opt/TileKernels/tile_kernels/__init__.py", []
    pkg.quant = types.ModuleType("tile_kernels.quant")
    utils = types.ModuleType("tile_kernels.utils")
    utils.ceil_div = lambda a, b: calls.append((a, b)) or -(-a // b)
    for name, mod in (("tile_kernels", pkg), ("tile_kernels.quant", pkg.quant), ("tile_kernels.utils", utils)):
        monkeypatch.setitem(sys.modules, name, mod)
    rows = run(modules=["fake"], against="tilekernels", timers=_FakeTimers(calls), out=io.StringIO(),
               cupti_only=True)
    by = {r["params"]: r for r in rows}
    assert by["kind=shared"]["tk_us"] == 20.0 and calls[0] == (7, 2)
    assert by["kind=missing"]["tk_status"] == "no TileKernels op: tile_kernels has no transpose.transpose"
    assert by["kind=other"]["tk_status"] == "no TileKernels op: another library's op"


def test_warm_only_runs_one_shard(monkeypatch, _fake_op, _clean_resolve):
    ran = []
    monkeypatch.setattr(tritile.utils, "ceil_div", lambda a, b: ran.append("ceil_div") or 4)
    resolve.cache_clear()
    out = io.StringIO()
    rows = run(modules=["fake"], warm_only=True, shard=(0, 2), out=out)
    assert [r["params"] for r in rows] == ["kind=shared", "kind=other"] and ran == ["ceil_div"]
    assert all(r["status"] == "warmed" for r in rows)
    with pytest.raises(ValueError, match="shard must be"):
        run(modules=["fake"], warm_only=True, shard=(2, 2), out=out)


_FAKE_WARM = """
import sys
i = sys.argv[sys.argv.index("--shard") + 1].split("/")[0]
assert sys.argv[1:6] == ["bench", "--module", "transpose", "--quick", "--against"], sys.argv
print("TileLang chatter")
print(f"warm: op{i} a={i}: warmed")
if i == "1":
    print("warm: op1 b=1: ERROR: RuntimeError: boom")
    sys.exit(1)
"""


def test_warm_in_parallel_reports_each_process():
    """``--warm-procs``: one ``bench ... --warm-only --shard i/n`` process per shard; the cases that failed there are
    listed, and a process that breaks (exit status other than 0 / 1) is reported with its output's tail."""
    from tritile.bench.runner import warm_in_parallel

    out = io.StringIO()
    n = warm_in_parallel(3, modules=["transpose"], quick=True, against="tilekernels", out=out,
                         command=[sys.executable, "-c", _FAKE_WARM])
    text = out.getvalue()
    assert n == 1 and "# warm-up: op1 b=1: ERROR: RuntimeError: boom" in text
    assert "# warm-up: 4 cases run once in 3 processes" in text and "1 failed" in text
    out = io.StringIO()
    assert warm_in_parallel(1, modules=["transpose"], quick=True, against="tilekernels", out=out,
                            command=[sys.executable, "-c", "import sys; print('broken'); sys.exit(3)"]) == 1
    assert "# warm-up process 0/1 ended with 3: broken" in out.getvalue()


def test_cli_warm_only_shard(_fake_op, _clean_resolve, capsys):
    from tritile.__main__ import main

    assert main(["bench", "--module", "fake", "--warm-only", "--shard", "1/2"]) == 0
    assert capsys.readouterr().out.strip() == "warm: fake_op kind=missing: warmed"
    for bad in ("2/2", "x/2", "1"):
        with pytest.raises(SystemExit):
            main(["bench", "--module", "fake", "--warm-only", "--shard", bad])


# ---------------------------------------------------------------------------------------------- summaries, results
_ROWS = [dict(module="quant", op="a", params="h=1", cupti_us=1.0, tk_us=2.0, vs_tk=2.0, eager_us=4.0, tk_eager_us=2.0,
              vs_tk_eager=0.5, host_cost_us=3.0, status="ok", tk_source="live"),
         dict(module="quant", op="a", params="h=2", cupti_us=2.0, tk_us=1.0, vs_tk=0.5, eager_us=4.0, tk_eager_us=8.0,
              vs_tk_eager=2.0, host_cost_us=2.0, status="ok", tk_source="live"),
         dict(module="moe", op="b", params="k=1", cupti_us=1.0, tk_us=1.0, vs_tk=1.0, status="ok", tk_source="live"),
         dict(module="moe", op="c", params="k=2", us=1.0, tk_status="no TileKernels op: x", status="ok")]


def test_tk_summary_and_grid_tables():
    s = tk_summary(_ROWS)
    a = s["ops"]["a"]
    assert (a["kernel"]["worst"], a["kernel"]["worst_at"], a["kernel"]["geomean"]) == (0.5, "h=2", 1.0)
    assert (a["eager"]["worst"], a["eager"]["worst_at"]) == (0.5, "h=1")
    assert s["modules"]["quant"]["kernel"]["below_1"] == 1 and s["modules"]["moe"]["kernel"]["n"] == 1
    assert "kernel" not in s["ops"]["c"]
    out = io.StringIO()
    print_grid_tables(_ROWS, out)
    text = out.getvalue()
    assert "| shape | TK µs | tritile µs | × TK | TK eager µs | eager µs | × TK eager | host cost µs |" in text
    assert "| h=1 | 2.0 | 1.0 | 2.00 | 2.0 | 4.0 | 0.50 | 3.0 |" in text
    assert ("a: 2 shapes, 2 with a TileKernels figure; worst 0.50× TK at h=2; geometric mean 1.00×.  Eager: worst "
            "0.50× TK at h=1; geometric mean 1.00×.") in text


def test_results_md_side(tmp_path):
    spec = importlib.util.spec_from_file_location("results_md", os.path.join(_ROOT, "scripts", "results_md.py"))
    results_md = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(results_md)
    meta = dict(date="2026-12-04", device="NVIDIA H200", torch="2.11", triton="3.6.0", commit="1234abc",
                tilekernels=dict(source="live", commit="36d9e45", path="/x"))
    p = tmp_path / "side.json"
    p.write_text(json.dumps(dict(meta=meta, rows=_ROWS)))
    text = results_md.render_side([str(p)])
    assert "Date: 2026-12-04; GPU: NVIDIA H200; tritile commit 1234abc; TileKernels commit 36d9e45" in text
    assert "### quant" in text and "### moe" in text and "#### a" in text
    assert "| quant | 2 | 1.00 | 1 | 1.00 | 1 |" in text  # module geomeans, kernel and eager
    assert "TileKernels commit 9" in results_md.render_side([str(p)], tk_commit="9")
    assert "| × TK eager |" in results_md.render([str(p)])
