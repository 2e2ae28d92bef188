#!/usr/bin/env python3
"""Instructions per element of the row kernels' hot loops, read from their SASS (no GPU needed).

    python scripts/sass_count.py                      # builds flce_rows.cu for sm_90a
    python scripts/sass_count.py --arch sm_100 --object build/flce_rows.o --kernel row_grad
    python scripts/sass_count.py --check             # exit 1 if an sm_90a instance is over BUDGETS

Compiles csrc/cuda/flce_rows.cu with nvcc for one architecture (or reads --object), dumps the
SASS with cuobjdump (PATH, $CUOBJDUMP, the CUDA toolkit, or pip's nvidia-cuda-cuobjdump), and
for every instance of row_stats_kernel / row_grad_kernel finds the tile loop: the innermost loop
(a backward branch) whose body holds the global loads of a tile. Its body is counted
instruction by instruction and divided by the columns a thread handles per iteration
(kPerThread = 16): the hot path's cost per logit. A loop body with branches inside (bounds or
flag checks per element) is counted whole, an upper bound on the path taken; the kernels' whole
-tile loops have none. Prints one line per instance: total, per element, and the classes that
matter for an issue-bound loop (MUFU: the exp; LDG/STG: memory; BRA/BAR: control).

--check holds every instance to its line of BUDGETS (instructions per logit, sm_90a; the table
and why in docs/cuda.md, "Row kernels"), and fails where an instance has no tile loop.
"""
import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PER_THREAD = 16  # flce_rows.cu kPerThread: columns per thread per tile
INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
FUNC = re.compile(r"Function\s*:\s*(\S+)")


# Instructions per logit allowed in the tile loop of each sm_90a instance: (kernel, transform,
# with options, limit), the first line that matches an instance applies. transform: the Xf
# template argument (none / affine: bias or temperature / cap: softcap); with options: row_stats
# with the logit sum or the entropy's u (kSum or kU), row_grad with residuals or column sums
# (kExtras); None matches both. 32 and 48 are what an H200's issue rate allows per fp32 logit at
# 4.2 TB/s (row_stats reads 4 bytes a logit, row_grad reads 4 and writes 2); the softcap's
# row_stats and the option-bearing instances are above them (docs/cuda.md).
BUDGETS = [
    ("row_stats", "cap", False, 44),
    ("row_stats", "cap", True, 60),
    ("row_stats", None, False, 32),
    ("row_stats", None, True, 44),
    ("row_grad", "cap", False, 50),
    ("row_grad", "cap", True, 68),
    ("row_grad", None, False, 48),
    ("row_grad", None, True, 48),
]
XF_NAMES = {"0": "none", "1": "affine", "2": "cap"}


def instance(short):
    """(kernel, transform, with options) of a shortened instance name, e.g.
    'void row_stats_kernel<float, (Xf)2, false, true>' -> ('row_stats', 'cap', True)."""
    m = re.search(r"(row_stats|row_grad)_kernel<(.*)>", short)
    if not m:
        return None
    args = [a.strip() for a in m.group(2).split(",")]
    xf = next((XF_NAMES[a[-1]] for a in args if a.startswith("(Xf)")), None)
    if m.group(1) == "row_stats":
        options = "true" in args[-2:]
    else:
        options = args[-1] == "true"
    return m.group(1), xf, options


def budget(short):
    inst = instance(short)
    if inst is None:
        return None
    kernel, xf, options = inst
    for k, x, o, limit in BUDGETS:
        if k == kernel and (x is None or x == xf) and (o is None or o == options):
            return limit
    return None


def cuobjdump(required=True):
    for cand in (os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump"),
                 "/usr/local/cuda/bin/cuobjdump"):
        if cand and os.path.exists(cand):
            return cand
    nvcc = shutil.which("nvcc")
    if nvcc:  # the toolkit's bin/ (nvcc may be reached through a link elsewhere)
        cand = os.path.join(os.path.dirname(os.path.realpath(nvcc)), "cuobjdump")
        if os.path.exists(cand):
            return cand
    import site

    for base in site.getsitepackages() + [site.getusersitepackages()] + sys.path:
        hits = (glob.glob(os.path.join(base, "nvidia", "*", "bin", "cuobjdump"))
                + glob.glob(os.path.join(base, "triton", "backends", "nvidia", "bin", "cuobjdump")))
        if hits:
            return hits[0]
    if not required:
        return None
    sys.exit("cuobjdump not found: install the toolkit's, or pip install nvidia-cuda-cuobjdump, "
             "or set CUOBJDUMP")


def build(arch, out):
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    cmd = [nvcc, "-std=c++20", "-O3", "--expt-relaxed-constexpr", "-D__CUDA_NO_HALF_OPERATORS__",
           "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
           "-D__CUDA_NO_HALF2_OPERATORS__", f"-gencode=arch=compute_{arch[3:]},code={arch}",
           "-I" + os.path.join(ROOT, "csrc"), "-I" + os.path.join(ROOT, "csrc", "include"),
           "-c", os.path.join(ROOT, "csrc", "cuda", "flce_rows.cu"), "-o", out]
    subprocess.run(cmd, check=True)


def functions(sass):
    """{mangled name: [(address, instruction text)]}"""
    out, name = {}, None
    for line in sass.splitlines():
        m = FUNC.search(line)
        if m:
            name = m.group(1)
            out[name] = []
            continue
        m = INSTR.match(line)
        if m and name:
            out[name].append((int(m.group(1), 16), m.group(2)))
    return out


def demangle(name):
    try:
        return subprocess.run(["c++filt", name], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return name


def tile_loop(instrs):
    """The instructions of the innermost backward-branch loop that holds a global load."""
    best = None
    for i, (addr, text) in enumerate(instrs):
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target > addr:
            continue
        body = [t for a, t in instrs if target <= a <= addr]
        if not any(t.split()[0].startswith("LDG") or " LDG" in t for t in body):
            continue
        if best is None or len(body) < len(best):
            best = body
    return best


def opcode(text):
    parts = text.split()
    op = parts[1] if parts[0].startswith("@") else parts[0]
    return op.split(".")[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--object", help="an object or cubin holding flce_rows.cu's kernels")
    ap.add_argument("--kernel", default="row_", help="substring of the kernels to count")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if an instance is over its BUDGETS line (sm_90a)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        obj = args.object
        if obj is None:
            obj = os.path.join(tmp, "flce_rows.o")
            build(args.arch, obj)
        sass = subprocess.run([cuobjdump(), "-sass", "-arch", args.arch, obj], check=True,
                              capture_output=True, text=True).stdout
    rows = []
    for name, instrs in functions(sass).items():
        pretty = demangle(name)
        short = re.sub(r"flce::cuda::\(anonymous namespace\)::", "", pretty)
        short = re.sub(r"\(flce::cuda::\w+\)$", "", short)
        if args.kernel not in short or not ("row_stats" in short or "row_grad" in short):
            continue
        body = tile_loop(instrs)
        if body is None:
            rows.append((short, None, None, {}))
            continue
        ops = collections.Counter(opcode(t) for t in body)
        rows.append((short, len(body), len(body) / PER_THREAD, ops))
    print(f"{args.arch}: instructions in the tile loop of each row kernel instance "
          f"(per element = / {PER_THREAD} columns per thread)")
    over = []
    for short, total, per, ops in sorted(rows):
        limit = budget(short)
        if total is None:
            print(f"{short:70s} no tile loop found")
            over.append(short)
            continue
        if limit is not None and per > limit:
            over.append(short)
        classes = {k: ops.get(k, 0) for k in ("MUFU", "LDG", "STG", "BRA", "BAR", "FFMA", "FADD",
                                              "FMUL", "FMNMX", "F2F", "F2FP", "PRMT", "ISETP",
                                              "FSETP", "SHF", "IMAD", "LEA", "FSEL", "SEL")}
        desc = " ".join(f"{k}={v}" for k, v in classes.items() if v)
        mark = f" (budget {limit})" if limit is not None else ""
        print(f"{short:70s} {total:5d} {per:6.1f}/elem{mark}  {desc}")
    if args.check:
        if args.arch != "sm_90a":
            sys.exit("--check: the budgets are sm_90a's")
        if not rows:
            sys.exit("--check: no row kernel instances found")
        if over:
            print(f"sass_count: {len(over)} instance(s) over budget or without a tile loop:")
            for short in over:
                print(f"  {short}")
            return 1
        print(f"sass_count: {len(rows)} instances within budget")
    return 0


if __name__ == "__main__":
    sys.exit(main())
