"""Bugs planted in the CUDA binding's row-chunk driver (csrc/cuda/chunks.cpp) and its gradient
accumulator (csrc/cuda/accumulate.cpp) that the cuda-host tests must catch.

The kernels have their own planted bugs (tests/cuda_host/mutations.py, ctest); the launch
sequences are host C++ that only the emulated torch binding runs. For each mutation this test
writes a mutated copy of the file, builds the emulated module with it in place of the original
(tests/cuda_emulation.py, FLCE_CUDA_HOST_MUTANT: a copy of the clean build, the one file
recompiled) and runs, in a fresh process, the tests that should catch it: they must fail on an
assertion (not on a build or import error). The clean sources pass the same tests in the main
run.
"""
import os
import subprocess
import sys

import pytest

import cuda_emulation

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, the suite's root
CUDA_SRC = os.path.join(cuda_emulation.ROOT, "csrc", "cuda")

# (name, file, original snippet (exactly once in the file), replacement, pytest selection)
MUTATIONS = [
    # fp16: the gradient tile's power-of-two scale left in dE.
    ("fp16_scale_left_in_dE", "accumulate.cpp",
     "  if (inv_scale_.defined()) ge.mul_(inv_scale_);\n", "\n",
     ["cuda/test_cuda.py::test_recompute_chunked"]),
    # Every group's target entries fixed with the first group's targets.
    ("target_fix_with_first_groups_targets", "accumulate.cpp",
     "  const at::Tensor tg = job_.target.narrow(0, g0, gn);\n",
     "  const at::Tensor tg = job_.target.narrow(0, 0, gn);\n",
     ["cuda/test_cuda.py::test_recompute_chunked", "cuda/test_cuda.py::test_single_pass_chunked"]),
    # The same bug, caught by the self-check a user runs (python -m flce.check): it names the
    # row-chunk paths (issue 50).
    ("target_fix_with_first_groups_targets_named_by_flce_check", "accumulate.cpp",
     "  const at::Tensor tg = job_.target.narrow(0, g0, gn);\n",
     "  const at::Tensor tg = job_.target.narrow(0, 0, gn);\n",
     ["tools/test_check.py::test_check_on_the_cuda_backend"]),
    # fp32 dW over several groups: each group's pieces written over the sum instead of added.
    ("dW_groups_overwritten", "accumulate.cpp",
     "      if (g0 == 0) {\n", "      if (g0 >= 0) {\n",
     ["cuda/test_cuda.py::test_recompute_chunked"]),
    # The given coefficients of a sub-chunk taken relative to its group instead of to row 0.
    ("given_coefficients_group_relative", "chunks.cpp",
     "      float* sub_coef = coef.data_ptr<float>() + (given ? s0 * 8 : 0);\n",
     "      float* sub_coef = coef.data_ptr<float>() + (given ? (s0 - g0) * 8 : 0);\n",
     ["cuda/test_cuda.py::test_recompute_chunked"]),
    # return_predicted_tokens: every chunk of rows' argmax columns written over the first
    # chunk's rows.
    ("argmax_of_every_chunk_at_row_0", "chunks.cpp",
     "    if (argmax != nullptr) row_argmax_into(rs, argmax->data_ptr<int64_t>() + s0);\n",
     "    if (argmax != nullptr) row_argmax_into(rs, argmax->data_ptr<int64_t>());\n",
     ["api/test_predicted_tokens.py::test_chunks_of_rows"]),
    # Soft mode: fp16's tile scale left out (the tile among fp16's subnormals at a small
    # upstream gradient).
    ("soft_fp16_tile_unscaled", "chunks.cpp",
     "  if (job.input.scalar_type() != at::kHalf) return at::Tensor();\n",
     "  if (job.soft || job.input.scalar_type() != at::kHalf) return at::Tensor();\n",
     ["cpu/test_distributions.py::test_cuda_chunked"]),
    # Soft mode: every sub-chunk reads the first sub-chunk's target rows.
    ("soft_targets_of_first_chunk", "chunks.cpp",
     "    m.y = soft_rows(*job.soft, s0);\n",
     "    m.y = soft_rows(*job.soft, 0);\n",
     ["cpu/test_distributions.py::test_cuda_chunked"]),
]


@pytest.mark.parametrize("name,file,original,replacement,tests", MUTATIONS,
                         ids=[m[0] for m in MUTATIONS])
def test_mutation_is_caught(name, file, original, replacement, tests, tmp_path):
    cuda_emulation.load_or_skip()
    text = open(os.path.join(CUDA_SRC, file)).read()
    assert text.count(original) == 1, f"{name}: the snippet occurs {text.count(original)} times"
    mutant = tmp_path / file
    mutant.write_text(text.replace(original, replacement))
    env = dict(os.environ, FLCE_CUDA_HOST_MUTANT=str(mutant))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        "-k", "cuda-host", *tests], cwd=HERE, env=env, capture_output=True,
                       text=True, timeout=900)
    out = p.stdout + p.stderr
    assert p.returncode == 1, f"{name}: the mutated driver was not caught (exit {p.returncode}):\n{out[-3000:]}"
    assert "AssertionError" in out or "assert " in out, f"{name}: failed, but not on a check:\n{out[-3000:]}"
