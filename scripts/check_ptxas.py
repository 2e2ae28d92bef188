#!/usr/bin/env python3
"""Fail a CUDA build whose flce kernels spill or use a stack frame beyond their allowance.

Usage: python scripts/check_ptxas.py BUILD_LOG [--quiet]

BUILD_LOG is the output of a build with FLCE_PTXAS_VERBOSE=1 (nvcc -Xptxas=-v). For every
kernel ("entry function") of namespace flce and every architecture, ptxas reports registers,
stack frame and spill bytes. Exit status 1 when any kernel exceeds its allowance below, when
ptxas serialized the WGMMA pipeline of an flce kernel (its advisories C7508-C7520, e.g. C7510
"wgmma.mma_async instructions are serialized due to wgmma pipeline crossing function boundary":
the tensor cores then wait on every WGMMA, a large share of Hopper's rate lost), or when the log
contains no flce kernel at all (the build was not verbose, or not a CUDA build).

The allowances are documented in docs/cuda.md ("ptxas allowance"); change both together.
"""
import re
import shutil
import subprocess
import sys

# Kernel base name -> (stack frame bytes, spill store bytes, spill load bytes) allowed.
# Every flce kernel is register-resident today (see the table in docs/cuda.md): no spills and
# no stack frame.
ALLOWANCE = {
    "row_coef_kernel": (0, 0, 0),
    "target_fix_kernel": (0, 0, 0),
    "combine_kernel": (0, 0, 0),
    "column_sum_kernel": (0, 0, 0),
    "kahan_accumulate_kernel": (0, 0, 0),
    "scale_store_kernel": (0, 0, 0),
    "distill_rows_kernel": (0, 0, 0),
}
DEFAULT_ALLOWANCE = (0, 0, 0)  # a new kernel must be listed or meet the strictest bound

ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_[0-9a-z]+)'")
PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
REGS = re.compile(r"Used (\d+) registers")
# ptxas's advisories that it serialized a function's wgmma.mma_async instructions, naming it.
WGMMA_SERIAL = re.compile(r"\((C75(?:0[89]|1\d|20))\)[^']*'([^']+)'")


def demangle(names):
    tool = shutil.which("c++filt") or shutil.which("cu++filt")
    if not tool or not names:
        return {n: n for n in names}
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True)
    lines = out.stdout.splitlines()
    if out.returncode != 0 or len(lines) != len(names):
        return {n: n for n in names}
    return dict(zip(names, lines))


def base_name(demangled):
    """'void flce::cuda::(anon)::row_grad_kernel<float, float, ...>(...)' -> name."""
    head = demangled.replace("(anonymous namespace)::", "").split("(")[0]
    head = re.sub(r"<.*", "", head)
    return head.split("::")[-1].split()[-1]


def parse(text):
    """[(mangled, arch, stack, spill_st, spill_ld, regs)] for every entry in the log."""
    rows = []
    cur = None
    for line in text.splitlines():
        m = ENTRY.search(line)
        if m:
            cur = {"name": m.group(1), "arch": m.group(2), "regs": None, "props": None}
            rows.append(cur)
            continue
        if cur is None:
            continue
        m = PROPS.search(line)
        if m and cur["props"] is None:
            cur["props"] = tuple(int(x) for x in m.groups())
            continue
        m = REGS.search(line)
        if m and cur["regs"] is None:
            cur["regs"] = int(m.group(1))
    return rows


def main(argv):
    if len(argv) < 2:
        print(__doc__)
        return 2
    quiet = "--quiet" in argv
    with open(argv[1], errors="replace") as f:
        text = f.read()
    rows = parse(text)
    rows = [r for r in rows if "4flce" in r["name"] or "flce::" in r["name"]]
    if not rows:
        print(f"check_ptxas: no flce kernels in {argv[1]} (build with FLCE_PTXAS_VERBOSE=1)")
        return 1
    serial = [(code, fn) for code, fn in WGMMA_SERIAL.findall(text)
              if "4flce" in fn or "flce::" in fn]
    names = demangle(sorted({r["name"] for r in rows} | {fn for _, fn in serial}))
    failures = []
    for code, fn in sorted(set(serial)):
        line = f"FAIL ({code}) wgmma serialized in {names[fn][:160]}"
        failures.append(line)
        print(line)
    seen = set()
    for r in rows:
        full = names[r["name"]]
        base = base_name(full)
        key = (full, r["arch"])
        if key in seen:  # the same file compiled twice (e.g. a rebuild in one log)
            continue
        seen.add(key)
        if r["props"] is None:
            failures.append(f"{base} [{r['arch']}]: no stack/spill line in the log")
            continue
        stack, st, ld = r["props"]
        allow = ALLOWANCE.get(base, DEFAULT_ALLOWANCE)
        ok = stack <= allow[0] and st <= allow[1] and ld <= allow[2]
        tmpl = re.search(r"<(.*)>\(", full)
        label = base + (f"<{tmpl.group(1)}>" if tmpl else "")
        label = label.replace("flce::cuda::", "").replace("(anonymous namespace)::", "")
        label = label if len(label) <= 100 else label[:97] + "..."
        line = (f"{'ok  ' if ok else 'FAIL'} {r['arch']:<8} {label:<58} regs {r['regs']!s:>4}  "
                f"stack {stack:>4}  spill st {st:>4} ld {ld:>4}  (allow {allow[0]}/{allow[1]}/{allow[2]})")
        if not ok:
            failures.append(line)
        if not quiet or not ok:
            print(line)
    if failures:
        print(f"check_ptxas: {len(failures)} kernel(s) over their allowance or serialized")
        return 1
    print(f"check_ptxas: {len(seen)} kernel builds within allowance")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
