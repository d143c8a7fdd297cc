#!/usr/bin/env python
"""Static instruction counts of the sorted operator's many-programs-a-row kernels, compiled for a GPU on any machine.

Where no GPU is at hand the kernels cannot be timed, but what they would issue can be counted. Each pass over a
row's entries (the forward's evaluation and plan, the backward's sums and gradient:
``sorted_soft_topk_split_triton``) is compiled ahead of time for ``sm_{--arch}`` both ways the launcher can take it:
the anchors unrolled (one entry a thread; k + 1 <= ``UNROLL_MAX_ANCHORS``) and ``(BLOCK, KP)`` tiles (``KP`` lanes,
a power of two and at least 16, for the k + 1 anchors: the one-program kernels' passes are the same tiles). Each
is disassembled (Triton's bundled ``cuobjdump``) and its main loop, the loop over a chunk's blocks (the longest
backward branch), counted:

* ``regs``, ``spill B``: registers a thread and bytes of spill stores (``ptxas -v``);
* ``loop``: instructions a thread issues in one iteration; ``entries/warp``: the entries a warp covers in one;
* ``warp instr/entry``: the first over the second, what the SMs' schedulers issue per entry of the row;
* ``MUFU``, ``LDG``, ``LDS+STS``, ``SHFL`` ``/entry``: special-function (exp2, log2, reciprocal), global-load,
  shared-memory (LDS, STS) and warp-shuffle instructions per entry (warp instructions).

A static count along the loop's straight line (branches inside it counted once, taken or not), not a time:
memory latency, occupancy and the float64 units' throughput are not in it. ``ratio`` is the tiles' warp
instructions an entry over the unrolled passes'.

Usage::

    python scripts/bench/kernel_instructions.py                     # k = 5 (beam 5), float32 and float64, sm_90
    python scripts/bench/kernel_instructions.py --k 5 7 --arch 80 --out table.md
"""

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

#: the passes over a row's entries: (label, kernel)
PASSES = (("forward: evaluation", "_split_evaluate_kernel"), ("forward: plan", "_split_plan_kernel"),
          ("backward: sums", "_split_backward_sums_kernel"), ("backward: gradient", "_split_backward_grad_kernel"))
_INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def _tool(name: str) -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name


def ptxas_usage(ptx: str, arch: int, workdir: Path) -> Tuple[Optional[int], Optional[int]]:
    """``(registers a thread, bytes of spill stores)`` that ``ptxas -v`` (Triton's bundled assemblers: the first
    that takes this PTX) reports; ``(None, None)`` where none does."""
    source = workdir / "kernel.ptx"
    source.write_text(ptx)
    gpu = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
    for name in ("ptxas", "ptxas-blackwell"):
        if not _tool(name).is_file():
            continue
        run = subprocess.run([str(_tool(name)), "-v", f"--gpu-name={gpu}", str(source), "-o",
                              str(workdir / "kernel.cubin")], capture_output=True, text=True)
        registers = re.findall(r"Used (\d+) registers", run.stderr)
        spills = re.findall(r"(\d+) bytes spill stores", run.stderr)
        if run.returncode == 0 and registers and spills:
            return int(registers[0]), sum(int(n) for n in spills)
    return None, None


def compile_ahead(kernel, signature: Dict[str, str], constexprs: dict, arch: int, dtype: str, options: dict):
    """``kernel`` compiled ahead of time for ``sm_{arch}`` (no GPU needed), its run-time arguments typed by
    ``signature`` (``D``: ``dtype``), with ``constexprs`` and the compiler ``options``."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile

    types = {arg: kind.replace("D", dtype) for arg, kind in signature.items()}
    types.update({arg: "constexpr" for arg in constexprs})
    return triton_compile(ASTSource(fn=kernel, signature=types, constexprs=constexprs),
                          target=GPUTarget("cuda", arch, 32), options=options)


def main_loop(sass: str) -> List[str]:
    """The opcodes (predicate and modifiers dropped) of the longest loop in ``sass`` (``cuobjdump -sass`` text):
    the instructions from a backward branch's target to the branch."""
    instructions = [(int(m.group(1), 16), m.group(2)) for m in map(_INSTRUCTION.match, sass.splitlines()) if m]
    best: List[str] = []
    for address, text in instructions:
        branch = re.search(r"\bBRA\s+(?:`\(\S+\)\s*)?(0x[0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < address:
            body = [t for a, t in instructions if int(branch.group(1), 16) <= a <= address]
            best = max(best, body, key=len)
    return [re.sub(r"^@!?U?P[T0-9]+\s+", "", text).split()[0].split(".")[0] for text in best]


def count_pass(kernel_name: str, k: int, unroll: bool, dtype: str, arch: int, workdir: Path) -> Dict[str, object]:
    """One pass compiled as the launcher would launch it on a GPU (k anchors + 1, unrolled or in tiles, ``dtype``
    scores, a mask where the pass reads one), and its counts (see the module's docstring)."""
    from fairseq_softtopk.ops.kernels import sorted_soft_topk_op, sorted_soft_topk_split_op as split_op

    kernel = getattr(split_op.kernel_module(), kernel_name)
    block, chunk, chunks, options = split_op.pass_geometry(10 ** 6, k, interpret=False, unroll=unroll)
    options = dict(options)
    constexprs = dict(BLOCK=block, KP=sorted_soft_topk_op.anchor_lanes(k), CHUNK=chunk, K1=options.pop("K1"))
    if "HAS_MASK" in kernel.arg_names:
        constexprs["HAS_MASK"] = True
    compiled = compile_ahead(kernel, split_op.KERNEL_SIGNATURES[kernel_name], constexprs, arch, dtype, options)
    registers, spills = ptxas_usage(compiled.asm["ptx"], arch, workdir)
    (workdir / "pass.cubin").write_bytes(compiled.asm["cubin"])
    sass = subprocess.run([str(_tool("cuobjdump")), "-sass", str(workdir / "pass.cubin")], capture_output=True,
                          text=True, check=True).stdout
    loop = main_loop(sass)
    per_warp = block / options["num_warps"]

    def per_entry(*opcodes: str) -> float:
        return sum(op in opcodes for op in loop) / per_warp

    return {"path": "unrolled" if constexprs["K1"] else f"tiles KP {constexprs['KP']}", "BLOCK": block,
            "warps": options["num_warps"], "regs": registers, "spill B": spills, "loop": len(loop),
            "entries/warp": per_warp, "warp instr/entry": len(loop) / per_warp, "MUFU/entry": per_entry("MUFU"),
            "LDG/entry": per_entry("LDG"), "LDS+STS/entry": per_entry("LDS", "STS"), "SHFL/entry": per_entry("SHFL")}


def table(ks: Sequence[int], dtypes: Sequence[str], arch: int) -> List[Dict[str, object]]:
    """Every pass, both paths where k allows unrolling, each ``(k, dtype)``; the tiles' rows carry ``ratio``."""
    from fairseq_softtopk.ops.kernels.sorted_soft_topk_op import unrolled_anchors

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in ks:
            for dtype in dtypes:
                for label, kernel_name in PASSES:
                    unrolled = None
                    for unroll in ([True, False] if unrolled_anchors(k) else [False]):
                        row = {"pass": label, "k": k, "dtype": dtype,
                               **count_pass(kernel_name, k, unroll, dtype, arch, Path(tmp))}
                        if unroll:
                            unrolled = row
                        elif unrolled is not None:
                            row["ratio"] = row["warp instr/entry"] / unrolled["warp instr/entry"]
                        rows.append(row)
    return rows


def markdown(rows: List[Dict[str, object]], arch: int, command: str) -> str:
    """The rows as a markdown table under a line naming the compiler, the target and ``command``."""
    import triton

    columns = ["pass", "k", "dtype", "path", "BLOCK", "warps", "regs", "spill B", "loop", "entries/warp",
               "warp instr/entry", "MUFU/entry", "LDG/entry", "LDS+STS/entry", "SHFL/entry", "ratio"]

    def cell(value) -> str:
        if value is None:
            return ""
        return f"{value:.2f}".rstrip("0").rstrip(".") if isinstance(value, float) else str(value)

    lines = [f"Static counts of the compiled kernels (Triton {triton.__version__}, sm_{arch}), not a time: `{command}`",
             "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, nargs="+", default=[5], help="selection sizes (k + 1 anchors)")
    parser.add_argument("--dtype", nargs="+", default=["fp32", "fp64"], choices=["fp32", "fp64"],
                        help="the scores' dtypes")
    parser.add_argument("--arch", type=int, default=90, help="the GPU architecture compiled for (90: H100, H200)")
    parser.add_argument("--out", type=Path, help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    try:
        import triton  # noqa: F401
    except ImportError:
        print("kernel_instructions: needs triton (the virtualenv's)", file=sys.stderr)
        return 2
    command = " ".join(["python scripts/bench/kernel_instructions.py", *(argv if argv is not None else sys.argv[1:])])
    text = markdown(table(args.k, args.dtype, args.arch), args.arch, command)
    print(text, end="")
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
