"""Run PyTorch's OpInfo database through ferry (tests/opinfo_sweep.py) and write the report.

    .venv/bin/python tests/opinfo_report.py --out docs/ops.md --json docs/opinfo.json \\
        [--placements cpu,emu,emu_op,emu_inductor] [--samples 2] [--jobs 2] [--ops add,cat] [--timeout 300]
    .venv/bin/python tests/opinfo_report.py --from-json docs/opinfo.json --out docs/ops.md   # markdown only
    .venv/bin/python tests/opinfo_report.py --placements cuda_op --json cuda.json --out cuda.md  # on a GPU

The ops run in `--jobs` worker processes (one torch thread each), each op's outcomes reported
back as one JSON line; an op that kills its worker is recorded as 'crashed', one running past
`--timeout` seconds as 'timeout', and the worker starts again after it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT / "src")]

import opinfo_sweep as sweep  # noqa: E402

# ---------------------------------------------------------------------------------------------
# worker: ops from a file, one JSON line per op on stdout


def worker(ops_file: str, placements: list[str], samples: int, dynamic: bool, dtype: str) -> None:
    import torch

    torch.set_num_threads(1)
    names = Path(ops_file).read_text().split()
    s = sweep.Sweep(samples, dynamic, getattr(torch, dtype))
    out = sys.stdout
    for name in names:
        out.write(json.dumps({"start": name}) + "\n")
        out.flush()
        outcomes = []
        for placement in placements:
            outcomes += [o.to_json() for o in s.run(name, placement)]
        s._last = None
        out.write(json.dumps({"done": name, "outcomes": outcomes}) + "\n")
        out.flush()


# ---------------------------------------------------------------------------------------------
# parent: workers over the ops, restarted after a crash or a timeout


class Worker:
    def __init__(self, ops: list[str], args, tmp: str, n: int):
        self.ops = list(ops)
        self.ops_file = os.path.join(tmp, f"ops-{n}.txt")
        Path(self.ops_file).write_text("\n".join(self.ops))
        out_path, self.err_path = os.path.join(tmp, f"out-{n}.jsonl"), os.path.join(tmp, f"err-{n}.txt")
        path = [str(ROOT / "src"), str(HERE)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(path))
        cmd = [sys.executable, __file__, "--worker", self.ops_file, "--placements", ",".join(args.placements),
               "--samples", str(args.samples), "--dtype", args.dtype] + ([] if args.dynamic else ["--no-dynamic"])
        # the worker writes through its own file descriptions; this process reads through another
        # (a shared one would share the offset: reading would move where the worker writes)
        with open(out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=ROOT, env=env)
        self.log = open(out_path)  # noqa: SIM115
        self.read_pos, self.current, self.started = 0, None, time.monotonic()
        self.done: list[str] = []

    def poll(self) -> list[dict]:
        """Finished ops' records since the last poll."""
        self.log.seek(self.read_pos)
        records = []
        while True:
            pos = self.log.tell()
            line = self.log.readline()
            if not line.endswith("\n"):
                self.read_pos = pos
                break
            rec = json.loads(line)
            if "start" in rec:
                self.current, self.started = rec["start"], time.monotonic()
            else:
                self.current = None
                self.done.append(rec["done"])
                records.append(rec)
        return records

    def remaining(self) -> list[str]:
        return self.ops[len(self.done):]

    def stderr_tail(self) -> str:
        with open(self.err_path, errors="replace") as f:
            lines = [line for line in f.read().splitlines() if line.strip()]
        return " | ".join(lines[-3:])[-600:]

    def close(self) -> None:
        self.log.close()


def lost(name: str, placements, status: str, message: str) -> list[dict]:
    return [sweep.Outcome(name, -1, p, "static", status, message).to_json() for p in placements]


def run_all(names: list[str], args) -> tuple[list[dict], bool]:
    """(every outcome, interrupted): on SIGTERM or Ctrl-C, the outcomes of the ops finished so far."""
    outcomes: list[dict] = []
    interrupted = False
    jobs = max(1, min(args.jobs, len(names)))
    queues = [names[i::jobs] for i in range(jobs)]
    total = len(names)
    with tempfile.TemporaryDirectory(prefix="ferry-opinfo-report-") as tmp:
        counter = 0
        workers = []
        for q in queues:
            workers.append(Worker(q, args, tmp, counter))
            counter += 1
        try:
            _supervise(workers, args, tmp, counter, total, outcomes)
        except (KeyboardInterrupt, SystemExit):
            interrupted = True
            print(f"interrupted: reporting the {len({o['op'] for o in outcomes})} ops finished", flush=True)
        finally:  # no worker outlives this process
            for w in workers:
                if w.proc.poll() is None:
                    w.proc.kill()
                    w.proc.wait()
                w.close()
    return outcomes, interrupted


def _supervise(workers: list[Worker], args, tmp: str, counter: int, total: int, outcomes: list[dict]) -> None:
    """Collects the workers' outcomes into `outcomes` until every op is done; replaces a worker
    that died or hung."""
    finished, t0 = 0, time.monotonic()

    def collect(records):
        nonlocal finished
        for rec in records:
            outcomes.extend(rec["outcomes"])
            finished += 1
            bad = [o for o in rec["outcomes"] if o["status"] in sweep.FAILURES]
            print(f"[{finished}/{total} {time.monotonic() - t0:6.0f}s] {rec['done']}"
                  + (f"  ({len(bad)} failing)" if bad else ""), flush=True)

    while workers:
        time.sleep(0.5)
        for w in list(workers):
            rc = w.proc.poll()  # before reading: every line of a finished worker is read
            collect(w.poll())
            timed_out = rc is None and w.current is not None and time.monotonic() - w.started > args.timeout
            if rc is None and not timed_out:
                continue
            if timed_out:
                w.proc.kill()
                w.proc.wait()
                collect(w.poll())
            rest = w.remaining()
            workers.remove(w)
            w.close()
            if rest:  # the op in progress (or the first not started) took the worker down
                name = w.current or rest[0]
                status = "timeout" if timed_out else "crashed"
                why = f"over {args.timeout}s" if timed_out else f"the worker process exited with {rc}: {w.stderr_tail()}"
                outcomes.extend(lost(name, args.placements, status, why))
                finished += 1
                print(f"[{finished}/{total}] {name}: {status} ({why})", flush=True)
                rest = [n for n in rest if n != name]
                if rest:
                    workers.append(Worker(rest, args, tmp, counter))
                    counter += 1


# ---------------------------------------------------------------------------------------------
# the markdown


def reason(message: str) -> str:
    """A refusal's first line with the names of one program taken out, to group refusals."""
    line = sweep.first_line(message)
    line = re.sub(r"'[^']*'", "'…'", line)
    line = re.sub(r"\b(u?)\d+\b", r"\1N", line)  # numbers, and unbacked symbols (u20)
    return line


def cell(text: str, limit: int = 220) -> str:
    text = " ".join(str(text).split())
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


COLUMNS = [
    ("equal", lambda o: o["status"] == "equal" and not o["random"]),
    ("equal (random: shape only)", lambda o: o["status"] == "equal" and o["random"]),
    ("refused, names the op", lambda o: o["status"] == "refused" and o["names_op"]),
    ("refused, does not", lambda o: o["status"] == "refused" and not o["names_op"]),
    ("input refused at the call (documented)", lambda o: o["status"] == "input refused"),
    ("not exportable", lambda o: o["status"] == "not exportable"),
    ("no dynamic variant", lambda o: o["status"] == "no dynamic variant"),
    ("eager error", lambda o: o["status"] == "eager error"),
    ("no tensor output", lambda o: o["status"] == "no tensor output"),
    ("no samples", lambda o: o["status"] == "no samples"),
    ("**wrong**", lambda o: o["status"] == "wrong"),
    ("**run-time error**", lambda o: o["status"] == "run-time error"),
    ("**crashed / timeout**", lambda o: o["status"] in ("crashed", "timeout")),
]


def grouped_by(outcomes, key) -> dict:
    """{(op, status, key(outcome)): [outcomes]}."""
    groups = collections.defaultdict(list)
    for o in outcomes:
        groups[(o["op"], o["status"], key(o))].append(o)
    return groups


def _listed(rows, placements) -> str:
    """'samples | placements | variants' cells of a group of outcomes."""
    samples = ", ".join(str(s) for s in sorted({o["sample"] for o in rows}))
    ps = ", ".join(p for p in placements if any(o["placement"] == p for o in rows))
    vs = ", ".join(v for v in ("static", "dynamic") if any(o["variant"] == v for o in rows))
    return f"{samples} | {ps} | {vs}"


def markdown(data: dict) -> str:
    meta, outcomes = data["meta"], data["outcomes"]
    placements, dtype = meta["placements"], meta.get("dtype", "float32")
    ops = sorted({o["op"] for o in outcomes})
    out = [
        "# ferry on PyTorch's OpInfo database",
        "",
        "<!-- generated by tests/opinfo_report.py: do not edit; run it again -->",
        "",
        f"Generated by `{meta['command']}` (torch {meta['torch']}, ferry {meta.get('ferry', '?')}, "
        f"{meta['seconds']:.0f} s on {meta.get('jobs', 'several')} worker processes).",
        "",
        f"- **Cases**: {'some' if meta.get('subset') else 'every'} OpInfo op with {dtype} support ({len(ops)} ops), "
        f"the first {meta['samples']} samples of "
        f"each (`op.sample_inputs('cpu', torch.{dtype})`), as a module taking the sample's tensors; exported with "
        "`torch.export` (non-strict), compiled by ferry, saved, loaded with `ferry.Module` and called on the "
        "sample and on fresh inputs (floating tensors moved a little).",
        "- **Compared** with eager PyTorch on the same inputs: outputs, and the inputs after the call (an op that "
        "writes an input must write it the same way); rtol 1e-4, atol 1e-5, NaN equal to NaN, shapes and dtypes "
        "exact, strides free. *random*: eager's result changes with the seed (or the graph hands out an empty or "
        "random op's result), so only shape, dtype and device are compared.",
        "- **dynamic**: the sample exported again with one bounded dynamic dim (dim 0 of the first input where it "
        "is at least 3, else the first dim of at least 3) and the dims export ties to it, then called at the "
        "sample's size, a smaller one that torch.export's own module accepts (the inputs narrowed, then copied to "
        "memory of their own), and the sample's again.",
        "- **Placements**: `cpu` no partitioner; `emu` every op ferry places on the emulated device emu:0, inputs "
        "and outputs left there (skip_h2d / skip_d2h); `emu_op` the ops on emu:0, inputs and outputs on the CPU; "
        "`emu_inductor` as `emu`, each partition compiled by Inductor at load (the `inductor` backend: its C++ code "
        "on the emulated device's memory); `cuda_op` the ops on cuda:0, against eager on cuda:0 (`cuda_inductor`: "
        "compiled by Inductor).",
        "- A wrong result says whether `ep.module()` (torch.export's own module) agrees with eager or with ferry.",
        "",
        "The harness is tests/opinfo_sweep.py; tests/test_opinfo.py runs a fixed subset (`FERRY_OPINFO=all`: "
        "every op). Bold columns are failures.",
        "",
        *([f"**Interrupted**: {len(ops)} of the {meta['ops']} ops ran.", ""] if meta.get("interrupted") else []),
        "## Summary",
        "",
        "Cases are (op, sample) pairs; an op with no samples counts once.",
        "",
        "| placement | variant | cases | " + " | ".join(name for name, _ in COLUMNS) + " |",
        "|---|---|---:|" + "---:|" * len(COLUMNS),
    ]
    for p in placements:
        for variant in ("static", "dynamic"):
            rows = [o for o in outcomes if o["placement"] == p and o["variant"] == variant]
            if not rows:
                continue
            counts = [sum(1 for o in rows if pred(o)) for _, pred in COLUMNS]
            out.append(f"| {p} | {variant} | {len(rows)} | " + " | ".join(str(c) for c in counts) + " |")

    refused = [o for o in outcomes if o["status"] == "refused"]
    out += ["", "## Refusals by reason", ""]
    if refused:
        by_reason = collections.defaultdict(list)
        for o in refused:
            by_reason[reason(o["message"])].append(o)
        out += ["| reason | " + " | ".join(placements) + " | ops |", "|---|" + "---:|" * len(placements) + "---|"]
        for r, rows in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
            per = [sum(1 for o in rows if o["placement"] == p) for p in placements]
            names = sorted({o["op"] for o in rows})
            shown = ", ".join(names[:8]) + (f", … ({len(names)} ops)" if len(names) > 8 else "")
            out.append(f"| {cell(r)} | " + " | ".join(map(str, per)) + f" | {cell(shown, 400)} |")
    else:
        out.append("None.")

    failures = [o for o in outcomes if o["status"] in sweep.FAILURES]
    out += ["", "## Failures: wrong results and run-time errors", "",
            "One row per op and error (cases whose messages differ only in numbers and names share a row).", ""]
    if failures:
        out += ["| op | samples | placements | variants | outcome | error |", "|---|---|---|---|---|---|"]
        for (op, status, _), rows in sorted(grouped_by(failures, lambda o: reason(o["message"])).items()):
            out.append(f"| {op} | {_listed(rows, placements)} | {status} | {cell(sweep.first_line(rows[0]['message']), 400)} |")
    else:
        out.append("None.")

    out += ["", "## Ops ferry refuses", "",
            "Each op with a sample that `ferry.compile` refused (CompileError), with the reason: the first line "
            "of the error. ✗: the message does not name the op.", ""]
    if refused:
        out += ["| op | samples | placements | variants | reason |", "|---|---|---|---|---|"]
        for (op, _, msg), rows in sorted(grouped_by(refused, lambda o: sweep.first_line(o["message"])).items()):
            mark = "" if all(o["names_op"] for o in rows) else "✗ "
            out.append(f"| {op} | {_listed(rows, placements)} | {mark}{cell(msg)} |")
    else:
        out.append("None.")

    not_exportable = collections.defaultdict(set)
    for o in outcomes:
        if o["status"] == "not exportable":
            not_exportable[o["op"]].add(o["sample"])
    out += ["", "## Not exportable", "",
            f"{len(not_exportable)} ops have a sample `torch.export` (non-strict) cannot export: not ferry's to run.",
            ""]
    if not_exportable:
        out += ["<details><summary>the ops</summary>", "", "| op | samples |", "|---|---|"]
        out += [f"| {op} | {', '.join(map(str, sorted(s)))} |" for op, s in sorted(not_exportable.items())]
        out += ["", "</details>"]
    return "\n".join(out) + "\n"


def dump(data: dict) -> str:
    """The JSON report with one outcome a line: small, and a rerun's diff shows the cases that changed."""
    lines = ",\n".join(json.dumps(o, separators=(",", ":")) for o in data["outcomes"])
    return f'{{"meta": {json.dumps(data["meta"], indent=1)},\n"outcomes": [\n{lines}\n]}}\n'


def source_state() -> str:
    """Which ferry ran: the git commit (+ 'with local changes') and a hash of src/ferry's files."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted((ROOT / "src" / "ferry").rglob("*.py")):
        h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "src"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout.strip()
        git = f"commit {head}" + (" with local changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        git = "no git"
    return f"{git}, src/ferry sha256 {h.hexdigest()[:12]}"


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="the markdown report (docs/ops.md)")
    ap.add_argument("--json", help="every outcome as JSON (docs/opinfo.json)")
    ap.add_argument("--from-json", help="write --out from this JSON, running nothing")
    ap.add_argument("--placements", default=",".join((*sweep.CPU_PLACEMENTS, "emu_inductor")),
                    help=f"comma-separated, of {', '.join(sweep.PLACEMENTS)} (default: the CPU ones, both backends)")
    ap.add_argument("--samples", type=int, default=sweep.DEFAULT_SAMPLES, help="samples per op (default 2)")
    ap.add_argument("--ops", help="comma-separated op ids (default: every float32 op)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: CPU count)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one op may take on all placements")
    ap.add_argument("--no-dynamic", dest="dynamic", action="store_false", help="skip the dynamic-size variant")
    ap.add_argument("--dtype", default="float32", help="the samples' dtype (default float32; e.g. bfloat16, int64, bool)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.placements = [p.strip() for p in args.placements.split(",") if p.strip()]
    for p in args.placements:
        if p not in sweep.PLACEMENTS:
            ap.error(f"unknown placement {p!r}: one of {', '.join(sweep.PLACEMENTS)}")
    if args.worker:
        worker(args.worker, args.placements, args.samples, args.dynamic, args.dtype)
        return 0
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
    else:
        import torch

        if any(p.startswith("cuda") for p in args.placements) and not torch.cuda.is_available():
            ap.error("--placements cuda_op and cuda_inductor need a GPU (torch.cuda.is_available() is False)")
        known = [sweep.op_id(op) for op in sweep.float32_ops(getattr(torch, args.dtype))]
        names = known if not args.ops else [n.strip() for n in args.ops.split(",") if n.strip()]
        unknown = sorted(set(names) - set(known))
        if unknown:
            ap.error(f"unknown op ids: {', '.join(unknown)}")
        t0 = time.monotonic()
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # killed: the workers are ended too (run_all)
        outcomes, interrupted = run_all(names, args)
        order = {n: i for i, n in enumerate(names)}
        outcomes.sort(key=lambda o: (order.get(o["op"], 0), args.placements.index(o["placement"])
                                     if o["placement"] in args.placements else 0, o["sample"], o["variant"]))
        command = "python tests/opinfo_report.py " + " ".join(a for a in (argv if argv is not None else sys.argv[1:]))
        data = {
            "meta": {"torch": torch.__version__, "placements": args.placements, "samples": args.samples, "dtype": args.dtype,
                     "dynamic": args.dynamic, "ops": len(names), "ferry": source_state(), "jobs": args.jobs,
                     "interrupted": interrupted, "subset": bool(args.ops), "seconds": round(time.monotonic() - t0, 1),
                     "command": command},
            "outcomes": outcomes,
        }
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(dump(data))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(markdown(data))
    fails = [o for o in data["outcomes"] if o["status"] in sweep.FAILURES]
    print(f"{len(data['outcomes'])} outcomes, {len(fails)} failures")
    return 0


if __name__ == "__main__":
    sys.exit(main())
