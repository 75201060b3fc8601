"""The `ferry` command, called in-process through ferry.cli.main (return code + captured output),
plus one real subprocess for `--help`."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import ferry
import ferry.examples
from ferry.cli import main
from ferry.program.report import copy_report
from ferry.runtime import emulated_device, get_allocator, unregister_allocator
from models import Add, fresh_inputs, small

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(autouse=True)
def no_leaked_emu():
    """`ferry compile/run` register the emulated device for emu programs, for the life of the
    process; undo that after each test so other tests can register their own."""
    before = get_allocator("emu")
    yield
    if before is None and get_allocator("emu") is not None:
        unregister_allocator("emu")


def call(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """`ferry compile ferry.examples:transformer_block -o F --device emu:0 --exclude aten.softmax`."""
    path = tmp_path_factory.mktemp("cli") / "block.ferry"
    had_emu = get_allocator("emu") is not None
    try:
        rc, out, err = call(["compile", "ferry.examples:transformer_block", "-o", path, "--device", "emu:0",
                             "--exclude", "aten.softmax"])
    finally:
        if not had_emu and get_allocator("emu") is not None:
            unregister_allocator("emu")
    return path, rc, out, err


def test_compile_writes_a_program(compiled):
    path, rc, out, err = compiled
    assert rc == 0, err
    assert path.is_file() and path.stat().st_size > 0
    assert "[ferry] torch.export done" in err and f"[ferry] save {path} done" in err
    assert "method 'forward'" in out and "copies of method 'forward'" in out and "on emu:0" in out
    program = ferry.load_program(path)
    m = program.methods["forward"]
    assert len(program.delegates) == 2 and all(d.spec("target_device") == b"emu:0" for d in program.delegates)
    assert "aten::softmax.int_out" in [getattr(i, "kernel", None) for i in m.instructions], "softmax stays on the CPU"
    assert [str(b.device) for b in m.buffers] == ["cpu:0", "cpu:0", "emu:0"]
    # the file runs and matches eager PyTorch
    model, example = ferry.examples.transformer_block()
    with emulated_device():
        module = ferry.Module(str(path))
        for seed in (1, 2):
            (x,) = fresh_inputs(example, seed)
            (got,) = module.run_method("forward", [x])
            torch.testing.assert_close(got, model(x), atol=1e-5, rtol=1e-4)


def test_inspect_prints_methods_instructions_copies_and_buffers(compiled):
    path = compiled[0]
    rc, out, err = call(["inspect", path])
    assert rc == 0 and err == ""
    program = ferry.load_program(path)
    m = program.methods["forward"]
    assert "method 'forward'" in out and "instructions:" in out
    lines = out.splitlines()
    ins_lines = [ln for ln in lines if re.match(r"\s+#\d+\s+(delegate|aten::|et_copy::)", ln)]
    assert len(ins_lines) == len(m.instructions)
    assert any("delegate 0 (torch on emu:0)" in ln for ln in ins_lines)
    assert any(ln.strip().startswith("#") and "aten::softmax.int_out" in ln and "@cpu:0[" in ln for ln in ins_lines)
    assert any("et_copy::_h2d_copy.out" in ln and "@cpu:0[" in ln and "@emu:0[" in ln for ln in ins_lines)
    rows = copy_report(program, "forward").rows
    assert rows and {r.direction for r in rows} == {"h2d", "d2h"}
    for r in rows:  # one line per copy, with its direction, devices and bytes
        assert any(f"#{r.instruction}" in ln and r.direction in ln and f"{r.nbytes:,} B" in ln
                   and r.src in ln and r.dst in ln for ln in lines), r
    for i, b in enumerate(m.buffers[1:], start=1):
        assert any(re.search(rf"buffer {i}:.* on {b.device}$", ln) for ln in lines), (i, b)
    for dev, lb in m.lower_bounds.items():
        assert f"{dev}: planned" in out and f"lower bound (peak live) {lb:,} B" in out


def test_inspect_json(compiled):
    path = compiled[0]
    rc, out, _ = call(["inspect", path, "--json"])
    assert rc == 0
    data = json.loads(out)
    fwd = data["methods"]["forward"]
    program = ferry.load_program(path)
    m = program.methods["forward"]
    assert [b["device"] for b in fwd["buffers"]] == [str(b.device) for b in m.buffers]
    assert [b["size"] for b in fwd["buffers"]] == [b.size for b in m.buffers]
    rep = copy_report(program, "forward")
    assert [(c["direction"], c["nbytes"], c["src"], c["dst"]) for c in fwd["copies"]] == [
        (r.direction, r.nbytes, r.src, r.dst) for r in rep.rows]
    assert fwd["copy_totals"]["h2d"] == {"count": rep.totals()["h2d"][0], "bytes": rep.totals()["h2d"][1]}
    assert len(fwd["instructions"]) == len(m.instructions)
    devices = {a["device"] for ins in fwd["instructions"] for a in ins["outputs"]}
    assert devices == {"cpu:0", "emu:0"}
    assert fwd["lower_bounds"] == m.lower_bounds
    assert [d["compile_specs"]["target_device"] for d in data["delegates"]] == ["emu:0", "emu:0"]


def test_run_prints_latency_and_copies(compiled):
    path = compiled[0]
    assert get_allocator("emu") is None, "run registers the emulated device itself"
    rc, out, err = call(["run", path, "--repeat", "3"])
    assert rc == 0, err
    assert "running on the emulated device" in out
    stats = re.search(r"method 'forward': 3 runs after 3 warm-up, median ([\d.]+) ms, p90 ([\d.]+) ms", out)
    assert stats and 0 < float(stats.group(1)) <= float(stats.group(2))
    assert "output 0: float32[2, 16, 64]" in out
    assert "copies of method 'forward'" in out
    assert "totals: h2d 2 copies / 16,384 B, d2h 2 copies / 16,384 B, d2d 0 copies / 0 B" in out
    assert "kernels chosen at load" not in out  # no GPU: nothing timed


def test_run_with_cuda_graphs_reports_what_was_captured(compiled):
    """The emulated device `ferry run` registers runs synchronously: nothing to capture, said so."""
    with pytest.warns(RuntimeWarning, match="captures no graph: none of its work runs on a GPU"):
        rc, out, err = call(["run", compiled[0], "--repeat", "2", "--cuda-graphs"])
    assert rc == 0, err
    assert re.search(r"^  graphs: 0 captured, 0 waiting for a second run$", out, re.M), out


def test_run_with_inputs_from_npz(compiled, tmp_path):
    path = compiled[0]
    good = tmp_path / "in.npz"
    np.savez(good, x=np.random.randn(2, 16, 64).astype(np.float32))
    rc, out, err = call(["run", path, "--inputs", good, "--repeat", "1"])
    assert rc == 0, err
    assert "method 'forward': 1 runs after" in out
    bad = tmp_path / "two.npz"
    np.savez(bad, a=np.zeros((2, 16, 64), np.float32), b=np.zeros((2, 16, 64), np.float32))
    rc, out, err = call(["run", path, "--inputs", bad])
    assert rc == 2 and err.startswith("ferry run: error:") and "2 arrays" in err and "1 inputs" in err


def _garbage(tmp_path):
    p = tmp_path / "garbage.ferry"
    p.write_bytes(os.urandom(256))
    return p


@pytest.mark.parametrize("argv,message", [
    (["inspect", "{tmp}/missing.ferry"], "No such file"),
    (["run", "{tmp}/missing.ferry"], "No such file"),
    (["inspect", "{garbage}"], "not a ferry program"),
    (["run", "{garbage}"], "not a ferry program"),
    (["compile", "no_colon_here", "-o", "{tmp}/out.ferry"], "package.module:function"),
    (["compile", ":transformer_block", "-o", "{tmp}/out.ferry"], "package.module:function"),
    (["compile", "ferry_no_such_module_xyz:build", "-o", "{tmp}/out.ferry"], "cannot import 'ferry_no_such_module_xyz'"),
    (["compile", "ferry.examples:no_such_factory", "-o", "{tmp}/out.ferry"], "no function 'no_such_factory'"),
    (["compile", "ferry.examples:transformer_block", "-o", "{tmp}/out.ferry", "--device", "tpu:0"], "unknown device type 'tpu'"),
    (["compile", "ferry.examples:transformer_block", "-o", "{tmp}/out.ferry", "--device", "gpu:0"], "known types: cpu, cuda, emu"),
    (["compile", "ferry.examples:transformer_block", "-o", "{tmp}/no/such/dir/out.ferry", "--device", "emu:0"], "does not exist"),
    (["compile", "ferry.examples:transformer_block", "-o", "{tmp}", "--device", "emu:0"], "is a directory"),
    (["run", "{garbage}", "--repeat", "0"], "--repeat: must be a positive integer"),
    (["run", "{garbage}", "--warmup", "-1"], "--warmup: must be a non-negative integer"),
    (["inspect", "{garbage}", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["compile", "ferry.examples:transformer_block", "-o", "{tmp}/out.ferry", "--device", "emu:0", "--exclude", "aten.no_such_op"], "no_such_op"),
])
def test_errors_are_one_line_exit_2(tmp_path, argv, message):
    argv = [a.format(tmp=tmp_path, garbage=_garbage(tmp_path)) for a in argv]
    rc, out, err = call(argv)
    assert rc == 2
    assert err.startswith(f"ferry {argv[0]}: error: "), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert message in err
    assert not (tmp_path / "out.ferry").exists()


@pytest.mark.parametrize("command", ["run", "inspect"])
def test_unknown_method_is_an_error(compiled, command):
    rc, out, err = call([command, compiled[0], "--method", "nope"])
    assert rc == 2 and err.startswith(f"ferry {command}: error:") and "no method 'nope'" in err
    assert err.count("\n") == 1 and "methods: forward" in err


def test_inspect_one_method(compiled):
    rc, out, err = call(["inspect", compiled[0], "--method", "forward", "--json"])
    assert rc == 0, err
    assert list(json.loads(out)["methods"]) == ["forward"]


def test_compile_with_a_missing_output_folder_fails_before_any_work(tmp_path):
    rc, out, err = call(["compile", "ferry.examples:transformer_block", "-o", tmp_path / "missing" / "x.ferry",
                         "--device", "emu:0"])
    assert rc == 2 and "[ferry]" not in err, "checked before loading, exporting or compiling the model"


class Masked(torch.nn.Module):
    def forward(self, x):
        return x.masked_fill(x > 1, float("-inf")).softmax(-1)


def test_inspect_json_is_strict_json_with_infinite_constants(tmp_path):
    path = tmp_path / "masked.ferry"
    ferry.compile(torch.export.export(Masked(), small(n=1))).save(path)
    rc, out, _ = call(["inspect", path, "--json"])
    assert rc == 0

    def no_constants(name):
        raise AssertionError(f"{name} is not JSON")

    data = json.loads(out, parse_constant=no_constants)
    consts = [a for ins in data["methods"]["forward"]["instructions"] for a in ins["args"] if a and a.get("kind") == "float"]
    assert {"kind": "float", "value": "-inf"} in consts


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_run_cuda_program_without_a_gpu(tmp_path):
    path = tmp_path / "add.ferry"
    ferry.compile(torch.export.export(Add(), small((2, 2))), ferry.OpSupportPartitioner("cuda:0")).save(path)
    rc, out, err = call(["run", path])
    assert rc == 2 and err.startswith("ferry run: error:") and err.count("\n") == 1
    assert "CUDA GPU" in err and "--device emu:0" in err  # what a CLI user can do about it


def test_help_in_a_subprocess():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "ferry.cli", "--help"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: ferry")
    for command in ("compile", "inspect", "run"):
        assert command in proc.stdout


def test_inspect_verify_checks_every_segment(tmp_path):
    path = tmp_path / "cpu.ferry"
    model, example = ferry.examples.transformer_block()
    ferry.compile(torch.export.export(model, example)).save(path)  # on the CPU: the weights are segments
    rc, out, err = call(["inspect", path, "--verify"])
    assert rc == 0 and "every checksum matches" in out, err
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10  # a byte of the last weight
    bad = tmp_path / "flipped.ferry"
    bad.write_bytes(bytes(data))
    assert call(["inspect", bad])[0] == 0  # weights are checked on request
    rc, out, err = call(["inspect", bad, "--verify"])
    assert rc == 2 and "does not match its SHA-256" in err and err.count("\n") == 1


def _weird_names_program(tmp_path):
    import dataclasses

    program = ferry.compile(torch.export.export(Add(), small((2, 3))))
    m = program.method("forward")
    m.values[0] = dataclasses.replace(m.values[0], name="x\x1b[2J\x07evil")
    path = tmp_path / "weird.ferry"
    program.save(path)
    return path


def test_inspect_escapes_control_characters_from_the_file(tmp_path):
    rc, out, err = call(["inspect", _weird_names_program(tmp_path)])
    assert rc == 0, err
    assert "\x1b" not in out and "\x07" not in out and "\\x1b[2J\\x07evil" in out


def test_a_factory_that_raises_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "bad_factory.py").write_text("def build():\n    raise RuntimeError('no weights here\\nsecond line')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rc, out, err = call(["compile", "bad_factory:build", "-o", tmp_path / "o.ferry", "--device", "emu:0"])
    last = err.strip().splitlines()[-1]
    assert rc == 2 and "Traceback" not in err and err.count("error:") == 1
    assert last == "ferry compile: error: bad_factory:build raised RuntimeError: no weights here"


def _factory(tmp_path, monkeypatch, name: str, params: str, returns: str, example: str) -> None:
    """A module `name` on the path whose build() gives a model returning `returns` from forward(`params`)."""
    (tmp_path / f"{name}.py").write_text(
        f"import torch\nclass M(torch.nn.Module):\n    def forward(self, {params}):\n        return {returns}\n"
        f"def build():\n    return M(), {example}\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_a_model_export_refuses_is_one_line(tmp_path, monkeypatch):
    _factory(tmp_path, monkeypatch, "unexportable", "x", "x.nonzero().sum() if x.sum() > 0 else x",
             "(torch.randn(3),)")
    rc, out, err = call(["compile", "unexportable:build", "-o", tmp_path / "o.ferry", "--device", "emu:0"])
    last = err.strip().splitlines()[-1]
    assert rc == 2 and "Traceback" not in err and last.startswith("ferry compile: error: torch.export of unexportable:build failed")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes")
def test_a_named_pipe_is_refused_at_once(tmp_path):
    fifo = tmp_path / "pipe.ferry"
    os.mkfifo(fifo)
    rc, out, err = call(["inspect", fifo])
    assert rc == 2 and "not a regular file" in err


def test_an_unwritable_output_names_the_path_given(tmp_path):
    program = ferry.compile(torch.export.export(Add(), small((2, 3))))
    target = tmp_path / "missing" / "out.ferry"
    with pytest.raises(FileNotFoundError) as err:
        program.save(target)
    assert str(target) in str(err.value) and ".tmp-" not in str(err.value)


def test_a_read_only_folder_names_the_path_given(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    program = ferry.compile(torch.export.export(Add(), small((2, 3))))
    folder.chmod(0o500)
    try:
        if os.access(folder, os.W_OK):
            pytest.skip("running as a user that can write anywhere")
        with pytest.raises(PermissionError, match=str(folder / "out.ferry")):
            program.save(folder / "out.ferry")
    finally:
        folder.chmod(0o700)


def test_compile_traced_ops_keeps_the_batch_norms_the_default_folds(tmp_path):
    """`--traced-ops` turns the inference rewrites off (eager's results bit for bit)."""
    kernels = {}
    had_emu = get_allocator("emu") is not None
    try:
        for flag in ([], ["--traced-ops"]):
            path = tmp_path / f"cnn{len(flag)}.ferry"
            rc, _, err = call(["compile", "ferry.examples:small_cnn", "-o", path, "--device", "emu:0", *flag])
            assert rc == 0, err
            program = ferry.load_program(path)
            kernels[bool(flag)] = [i.kernel for d in program.delegates
                                   for i in ferry.load_program(program.segments[d.payload], segments=program.segments).method("forward").instructions
                                   if hasattr(i, "kernel")]
    finally:
        if not had_emu and get_allocator("emu") is not None:
            unregister_allocator("emu")
    bn = "aten::_native_batch_norm_legit_no_training.default"
    assert kernels[True].count(bn) == 2 and bn not in kernels[False]


def test_run_prints_the_kernel_choices_made_at_load(compiled, timed):
    """With a GPU (faked here: conftest's `timed` favours the split), `ferry run` says which
    kernels load chose instead of eager's: the block's four biased GEMMs, each timed once."""
    rc, out, err = call(["run", compiled[0], "--repeat", "2"])
    assert rc == 0, err
    line = re.search(r"kernels chosen at load, biased GEMM: (\d+) of (\d+) timed at load are faster as mm \+ bias "
                     r"\(largest saving: \d+x\d+x\d+ float32, 100\.0 -> 40\.0 µs\)", out)
    assert line and line.group(1) == line.group(2) and int(line.group(2)) >= 2, out
    assert "attention:" not in out  # no graphs: no attention (nor multi-head attention) is timed


def test_run_decisions_lists_every_timed_choice(compiled, timed):
    """`--decisions` prints one line per decision timed at load, with both forms' times and the pick."""
    timed.times = (30.0, 29.0)  # the split saves too little: eager's addmm is kept
    rc, out, err = call(["run", compiled[0], "--repeat", "2", "--decisions"])
    assert rc == 0, err
    lines = re.findall(r"biased GEMM (\d+)x(\d+)x(\d+) float32 on \S+: addmm 30\.0 µs, mm \+ bias 29\.0 µs -> addmm "
                       r"\(mm \+ bias saves less than 10% and 2 µs\)", out)
    summary = re.search(r"biased GEMM: 0 of (\d+) timed at load", out)
    assert summary and len(lines) == int(summary.group(1)) >= 2, out
    rc, out, err = call(["run", compiled[0], "--repeat", "2"])
    assert rc == 0 and " -> addmm (" not in out  # only asked for


@pytest.mark.parametrize("argv", [
    ["run", "F", "--microbatches", str(10**30)],
    ["run", "F", "--repeat", "1" * 200],
    ["run", "F", "--warmup", "-1"],
    ["compile", "ferry.examples:transformer_block", "-o", "X", "--device-map", "[" * 100_000 + "]" * 100_000],
    ["compile", "ferry.examples:transformer_block", "-o", "X", "--device-map", "{" + '"a":{' * 50_000 + "}" * 50_001],
    ["compile", "ferry.examples:transformer_block", "-o", "X", "--device-map", "auto", "--max-memory",
     "emu:0=" + "9" * 400 + "GiB"],
])
def test_absurd_flags_are_one_line_and_exit_2(argv, compiled):
    argv = [compiled[0] if a == "F" else a for a in argv]
    rc, out, err = call(argv)
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-500:]


def test_random_inputs_larger_than_memory_are_refused_before_allocating(compiled, monkeypatch):
    import ferry.cli

    monkeypatch.setattr(ferry.cli, "_host_bytes", lambda: 1 << 20)  # a 1 MiB machine
    rc, out, err = call(["run", compiled[0], "--microbatches", "1000", "--repeat", "1"])
    assert rc == 2 and "more than half of this machine's memory" in err, err


# ---- progress bars on a terminal's stderr (cli_progress.py)


class _Terminal(io.StringIO):
    """stderr as a terminal: the CLI draws progress bars only there."""

    def isatty(self) -> bool:
        return True


def call_on_a_terminal(argv):
    out, err = io.StringIO(), _Terminal()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def _timings_out(text: str) -> str:
    """stdout with the numbers that vary from run to run (latencies) taken out."""
    return re.sub(r"[\d.]+ ms", "N ms", text)


def test_compile_draws_progress_on_a_terminal_and_leaves_stdout_as_it_is(tmp_path):
    argv = ["compile", "ferry.examples:transformer_block", "-o", tmp_path / "b.ferry", "--device", "emu:0"]
    rc, out, err = call_on_a_terminal(argv)
    assert rc == 0, err
    rc_quiet, out_quiet, err_quiet = call_on_a_terminal([*argv, "--no-progress"])
    assert rc_quiet == 0, err_quiet
    assert out == out_quiet and out == call(argv)[1]  # bars or not, terminal or not: the same stdout
    assert re.search(r"compile: +\d+%\|.*\| \d/2 ", err), err  # one method: placed, then emitted
    assert "compile:" not in err_quiet and "%|" not in err_quiet
    assert "[ferry] torch.export done" in err and "[ferry] torch.export done" in err_quiet


def test_run_draws_loading_progress_and_leaves_stdout_as_it_is(compiled):
    path = compiled[0]
    rc, out, err = call_on_a_terminal(["run", path, "--repeat", "2"])
    assert rc == 0, err
    rc_plain, out_plain, err_plain = call(["run", path, "--repeat", "2"])
    assert rc_plain == 0, err_plain
    assert _timings_out(out) == _timings_out(out_plain)
    assert re.search(r"load forward: +\d+%\|.*\| \d/3 ", err), err  # its two delegates, then the method
    assert re.search(r"upload weights: [\d.]+[kMG]?B ", err), err  # the emulated device's weights, in bytes
    assert "%|" not in err_plain


def test_compile_keeps_the_last_position_when_asked(tmp_path):
    """`--last-position`: the block's [2, 16, 64] result becomes its last position, [2, 1, 64],
    equal to eager's `[:, -1:]` (the CPU here: no device to register)."""
    from ferry.examples import transformer_block

    path = tmp_path / "last.ferry"
    rc, _, err = call(["compile", "ferry.examples:transformer_block", "-o", path, "--device", "cpu", "--last-position"])
    assert rc == 0, err
    model, (x,) = transformer_block()
    got = ferry.Module(path)(x)
    assert got.shape == (2, 1, 64)
    torch.testing.assert_close(got, model(x)[:, -1:], rtol=1e-4, atol=1e-5)


def test_a_factory_may_give_keyword_inputs_and_run_feeds_them(tmp_path, monkeypatch, emu):
    _factory(tmp_path, monkeypatch, "keyword_factory", "x, *, mask", "{'y': x * mask}",
             "(torch.randn(2, 3),), {'mask': torch.randn(2, 3)}")
    rc, out, err = call(["compile", "keyword_factory:build", "-o", tmp_path / "k.ferry", "--device", "emu:0"])
    assert rc == 0, err
    rc, out, err = call(["inspect", tmp_path / "k.ferry"])
    assert rc == 0 and "called as forward(x, *, mask) -> {'y': T}" in out, err
    x, mask = torch.randn(2, 3), torch.randn(2, 3)
    torch.testing.assert_close(ferry.Module(tmp_path / "k.ferry")(x, mask=mask)["y"], x * mask)
    rc, out, err = call(["run", tmp_path / "k.ferry", "--repeat", "2"])
    assert rc == 0, err
