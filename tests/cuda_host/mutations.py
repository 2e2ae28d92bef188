#!/usr/bin/env python3
"""Planted bugs that the cuda-host checks must catch.

Each mutation is (file, an exact snippet that occurs exactly once, its replacement, the build,
the test to run, the expected kind of report). For each one this script copies csrc/ to a
scratch directory, applies the mutation there, recompiles only the kernel TUs that include the
mutated file (with the flags of tools/cuda_host/build_info.py, the ones CMake uses), relinks the
test program with the unchanged objects of the CMake build, runs the test and requires it to FAIL
with the expected report. (Every TU that includes a mutated header is rebuilt: the host linker
keeps one copy of an inline function for all TUs, where nvcc compiles each TU's device code on
its own.) The unmutated CMake-built program must PASS the same test (else the
mutation would prove nothing).

Usage: mutations.py BUILD_JSON [NAME ...]   (BUILD_JSON: tests/cuda_host/mutation_build.json in
the CMake build directory; NAMEs select mutations). Run by ctest (cuda_host.mutations).
"""
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

RACE = r"shared-memory race|uninitialized shared memory"
NUMERIC = r"elements out of bounds \["
ASAN_OOB = r"AddressSanitizer: heap-buffer-overflow"

GRAD = "csrc/cuda/flce_grad.cu"
ROWS = "csrc/cuda/flce_rows.cu"
DISTILL = "csrc/cuda/flce_distill.cu"

MUTATIONS = [
    # distill_rows' P_S - P_T at a dominant class both models share taken as the difference of
    # the two probabilities near 1 instead of e_T - e_S: the collapsed row's largest gradient
    # entry (~1e-10) rounds to 0.
    dict(name="distill_shared_class_difference",
         file=DISTILL, config="plain", test="distill_rows", expect=NUMERIC,
         original="        const T diff = j == shared_a ? diff_a : ps - pt;\n",
         replacement="        const T diff = ps - pt;\n"),
    # row_coef's bound of |dz| without the chain rule's 1/T (the fp16 tile's scale overflowed at
    # T = 0.05 before the fix).
    dict(name="temperature_dropped_from_gradient_bound",
         file=GRAD, config="plain", test="low_temperature",
         expect=r"bound >= max_j \|dz_j\|: \d+ of \d+ elements out of bounds",
         original="ent_bound) / p.temperature;\n",
         replacement="ent_bound);\n"),
    # target_fix storing the residual's product instead of adding it to the dE row.
    dict(name="target_fix_overwrites_row",
         file=GRAD, config="plain", test="single_pass_rows", expect=NUMERIC,
         original="    s[j] += r * to_float<T>(w[j * p.weight_col_stride]);\n",
         replacement="    s[j] = r * to_float<T>(w[j * p.weight_col_stride]);\n"),
    # row_stats' partials stored one row down: the last shard's last row lands past the buffer.
    dict(name="rows_partials_store_one_row_past",
         file=ROWS, config="asan", test="single_pass_rows", expect=ASAN_OOB,
         original="store_partial(p.partials + (blockIdx.y * p.n + row) * kPartialCols, all.lse, all.zt,",
         replacement="store_partial(p.partials + (blockIdx.y * p.n + row + 1) * kPartialCols, all.lse, all.zt,"),
    # Thread 0 merging the warps' partials before every warp has stored its own.
    dict(name="rows_no_barrier_before_warp_merge",
         file=ROWS, config="racecheck", test="single_pass_rows", expect=RACE,
         original="    if (lane == 0) warp_part[warp] = part;\n    __syncthreads();\n",
         replacement="    if (lane == 0) warp_part[warp] = part;\n"),
    # The entropy's sum u of the row's tiles lost (u = 0): H_x = log s alone.
    dict(name="rows_entropy_sum_dropped",
         file=ROWS, config="plain", test="single_pass_rows", expect=NUMERIC,
         original="        if constexpr (kU) tu += ex == 0.f ? 0.f : ex * (ref - x[e]);\n",
         replacement=""),
    dict(name="no_barrier_before_in_place_gradient",
         file=ROWS, config="plain", test="single_pass_rows", expect=NUMERIC,
         original="        if constexpr (sizeof(T) < sizeof(TIn)) __syncthreads();\n",
         replacement="\n"),
    # 16-bit logits (a caller's, flce::logits_stats / logits_backward) read with the two halves
    # of each pair swapped, as a misread packed bf16x2 / half2 would: both row kernels' loads.
    dict(name="logits16_pack_order_swapped",
         file=ROWS, config="plain", test="logits16_rows", expect=NUMERIC,
         original="    for (int k = 0; k < kVec; ++k) x[i * kVec + k] = to_float<TIn>(t.q[i].v[k]);\n",
         replacement="    for (int k = 0; k < kVec; ++k) {\n"
                     "      x[i * kVec + k] = to_float<TIn>(t.q[i].v[sizeof(TIn) == 2 ? k ^ 1 : k]);\n"
                     "    }\n"),
    # The whole-tile loop's prefetch reads the current tile again instead of the next one.
    dict(name="row_prefetch_wrong_tile",
         file=ROWS, config="plain", test="single_pass_rows", expect=NUMERIC,
         original="      if (c0 + 2 * kTile <= cols.end) load_full(z + c0 + kTile, next);\n",
         replacement="      if (c0 + 2 * kTile <= cols.end) load_full(z + c0, next);\n"),
    # The target located in the wrong thread's columns (its group index taken as the thread).
    dict(name="target_slot_wrong_owner",
         file=ROWS, config="plain", test="logits16_rows", expect=NUMERIC,
         original="  return group % kThreads == static_cast<int>(threadIdx.x) ? (group / kThreads) * kVec + r % kVec\n",
         replacement="  return group / kThreads == static_cast<int>(threadIdx.x) ? (group / kThreads) * kVec + r % kVec\n"),
    # The row kernels' logit transform (flce_rows.cu xform_logit / xform_grad): the temperature
    # applied twice without a softcap; the softcap's derivative dropped from the chain rule (1 / T
    # alone); tanh's exp form with the wrong sign (1 + 2 / (E + 1)); the bias's 16-byte loads of
    # whole tiles taken from the neighbouring thread's columns.
    dict(name="rows_temperature_twice",
         file=ROWS, config="plain", test="single_pass_rows", expect=NUMERIC,
         original="      return fabsf(u) == INFINITY ? q : fmaf(fmaf(-c.temp, q, u), c.inv_t, q);\n",
         replacement="      return fabsf(u) == INFINITY ? q : fmaf(fmaf(-c.temp, q, u), c.inv_t, q) * "
                     "c.inv_t;\n"),
    dict(name="rows_softcap_derivative_dropped",
         file=ROWS, config="plain", test="single_pass_rows", expect=NUMERIC,
         original="    return fmaf(-t, t, 1.f) * c.inv_t;\n",
         replacement="    return c.inv_t;\n"),
    dict(name="rows_tanh_exp_form_sign",
         file=ROWS, config="plain", test="single_pass_rows", expect=NUMERIC,
         original="      const float t = fmaf(-2.f, rcp_approx(e + 1.f), 1.f);\n",
         replacement="      const float t = fmaf(2.f, rcp_approx(e + 1.f), 1.f);\n"),
    # The target's gradient (taken once per row in row_grad) from its logit without the bias.
    dict(name="rows_target_grad_without_bias",
         file=ROWS, config="plain", test="single_pass_rows", expect=NUMERIC,
         original="        if (kXf != Xf::kNone && xf.bias != nullptr) ut += xf.bias[tcol];\n",
         replacement="\n"),
    # return_predicted_tokens' argmax pass: equal maxima merged to the later column (lanes,
    # warps and tiles), not torch.argmax's first.
    dict(name="rows_argmax_ties_to_later_column",
         file=ROWS, config="plain", test="row_argmax", expect=r"row_argmax .*: row \d+ column",
         original="  return a.col < 0 || b.m > a.m || (b.m == a.m && b.col < a.col) ? b : a;\n",
         replacement="  return a.col < 0 || b.m > a.m || (b.m == a.m && b.col > a.col) ? b : a;\n"),
    dict(name="rows_bias_pack_offset",
         file=ROWS, config="plain", test="single_pass_rows", expect=NUMERIC,
         original="      const Pack<float> q = *reinterpret_cast<const Pack<float>*>(b + j);\n",
         replacement="      const Pack<float> q = *reinterpret_cast<const Pack<float>*>(b + (j ^ kVec));\n"),
]


def run_test(binary, test, timeout=600):
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0", UBSAN_OPTIONS="print_stacktrace=1",
               FLCE_HOST_SYMBOLIZE="1")
    try:
        p = subprocess.run([binary, test], capture_output=True, text=True, timeout=timeout, env=env)
        return p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        return 124, f"timeout after {timeout} s\n{e.stdout or ''}{e.stderr or ''}"


def including_tus(root, rel):
    """The kernel .cu files of csrc/cuda that include `rel` (directly or through headers)."""
    cuda = os.path.join(root, "csrc", "cuda")
    target = os.path.normpath(os.path.join(root, rel))

    def includes(path, seen):
        if path in seen or not os.path.isfile(path):
            return seen
        seen.add(path)
        for inc in re.findall(r'^#include "([^"]+)"', open(path).read(), re.M):
            includes(os.path.normpath(os.path.join(os.path.dirname(path), inc)), seen)
        return seen

    return [f for f in sorted(os.listdir(cuda)) if f.endswith(".cu")
            and target in includes(os.path.join(cuda, f), set())]


def mutate(cfg, m, bi):
    root = cfg["source_root"]
    src_path = os.path.join(root, m["file"])
    text = open(src_path).read()
    count = text.count(m["original"])
    if count != 1:
        return False, f"the original snippet occurs {count} times in {m['file']} (must be once)"
    work = os.path.join(cfg["work_dir"], m["name"])
    shutil.rmtree(work, ignore_errors=True)
    for sub in ("csrc/include", "csrc/cuda"):
        shutil.copytree(os.path.join(root, sub), os.path.join(work, sub))
    with open(os.path.join(work, m["file"]), "w") as f:
        f.write(text.replace(m["original"], m["replacement"]))
    info = bi["build_info"](m["config"])
    info["include_dirs"] = [d.replace(os.path.join(root, "csrc"), os.path.join(work, "csrc"))
                            for d in info["include_dirs"]]
    kernel_objects = cfg["kernel_objects"][m["config"]].split(";")
    tus = including_tus(root, m["file"])
    if not tus:
        return False, f"no kernel TU includes {m['file']}"
    mutated = []
    for tu in tus:
        obj = os.path.join(work, tu + ".o")
        # -O0 (the last -O wins): a planted bug is a bug at any optimization level, and the
        # heaviest TU (flce_rows.cu, its 100+ kernel instances) compiles ~5x faster than at -O2,
        # its test ~2x slower: the unmutated objects stay as CMake built them.
        cmd = bi["compile_command"](info, os.path.join(work, "csrc", "cuda", tu), obj, True,
                                    cfg["compiler"], extra=("-O0",))
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            return False, f"compiling the mutated {tu} failed:\n{p.stderr[-2000:]}"
        mutated.append(obj)
        kernel_objects = [k for k in kernel_objects if not os.path.basename(k).startswith(tu + ".")]
    exe = os.path.join(work, "test_kernels")
    link = ([cfg["compiler"]] + cfg["harness_objects"][m["config"]].split(";") + mutated
            + kernel_objects
            + [cfg["runtime_libraries"][m["config"]]] + info["ldflags"] + ["-o", exe])
    p = subprocess.run(link, capture_output=True, text=True)
    if p.returncode != 0:
        return False, f"linking failed:\n{p.stderr[-2000:]}"
    rc, out = run_test(exe, m["test"])
    if rc == 0:
        return False, "the mutated build PASSED: the checks missed the bug"
    if not re.search(m["expect"], out):
        return False, f"failed (exit {rc}) but without the expected report /{m['expect']}/:\n" + out[-3000:]
    hit = re.search(m["expect"], out)
    found = out[out.rfind("\n", 0, hit.start()) + 1:out.find("\n", hit.end())].strip()[:160]
    return True, f"caught (exit {rc}, rebuilt {', '.join(tus)}): {found}"


LOG = []


def say(text):
    """Print, and keep for mutations.log next to the work directory (kept after the run)."""
    print(text, flush=True)
    LOG.append(text)


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    cfg = json.load(open(sys.argv[1]))
    wanted = set(sys.argv[2:])
    muts = [m for m in MUTATIONS if not wanted or m["name"] in wanted]
    bi = runpy.run_path(os.path.join(cfg["source_root"], "tools", "cuda_host", "build_info.py"))
    os.makedirs(cfg["work_dir"], exist_ok=True)
    t0 = time.time()
    failures = 0
    # The clean builds must pass every test a mutation uses.
    for config, test in sorted({(m["config"], m["test"]) for m in muts}):
        rc, out = run_test(cfg["binaries"][config], test)
        status = "passes" if rc == 0 else f"FAILS (exit {rc})"
        say(f"clean {config:9s} {test:18s} {status}")
        if rc != 0:
            failures += 1
            say(out[-6000:])
    with ThreadPoolExecutor(max_workers=2) as ex:
        results = list(ex.map(lambda m: (m, mutate(cfg, m, bi)), muts))
    for m, (ok, msg) in results:
        say(f"{'ok  ' if ok else 'FAIL'} {m['name']:40s} [{m['config']}, {m['test']}] {msg}")
        failures += 0 if ok else 1
    say(f"{len(muts)} mutations, {failures} problem(s), {time.time() - t0:.0f} s")
    with open(os.path.join(os.path.dirname(cfg["work_dir"]), "mutations.log"), "w") as f:
        f.write("\n".join(LOG) + "\n")
    if failures == 0:
        shutil.rmtree(cfg["work_dir"], ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
