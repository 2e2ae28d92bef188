"""The differential fuzzer (tests/fuzz.py): a short seeded run per backend, the defects it found as
regression cases, and proof that its bounds catch planted errors.

The long run is on demand: ``python tests/fuzz.py --minutes 15 --backend cpu`` (or cuda-host).
"""
import dataclasses

import pytest
import torch

import fuzz
from fuzz import Case

# Cases per backend in the short run, from a fixed seed (deterministic: the same cases every
# run); about 30 s each on 2 cores. The time cap only guards against a hang.
SHORT_RUN = {"cpu": 160, "cuda-host": 90}


def _short_run(backend):
    n, failures = fuzz.fuzz(backend, seconds=120, seed=0, max_cases=SHORT_RUN[backend])
    assert not failures, "\n".join(failures)
    assert n == SHORT_RUN[backend], f"only {n} cases ran within the time cap"


def test_short_run_cpu():
    _short_run("cpu")


@pytest.mark.cuda_host
def test_short_run_cuda_host():
    _short_run("cuda-host")


# The defects the fuzzer found (issue 41), each as the case that shows it.
REGRESSIONS = {
    # the CUDA single pass's target-entry fix read a transposed classifier's weight[t] with its
    # row stride only: 16-bit inputs, 16-bit or fp32 master weights
    "transposed_classifier_bf16": Case(seed=41, backend="cuda-host", lead=(17,), v=64, d=24,
                                       dtype="bf16", w_layout="transposed", single_pass=True,
                                       reduction="sum"),
    "transposed_classifier_master": Case(seed=42, backend="cuda-host", lead=(9,), v=33, d=16,
                                         dtype="bf16", master=True, w_layout="transposed",
                                         single_pass=True),
    "strided_classifier_fp16": Case(seed=43, backend="cuda-host", lead=(9,), v=33, d=16,
                                    dtype="fp16", w_layout="strided", single_pass=True,
                                    reduction="sum"),
    # an empty batch of column-strided logits raised a stride error
    "empty_strided_logits": Case(seed=44, entry="logits", lead=(0,), v=10, x_layout="strided",
                                 reduction="sum"),
    "empty_strided_logits_cuda": Case(seed=44, backend="cuda-host", entry="logits", lead=(0,),
                                      v=10, x_layout="strided", reduction="sum"),
    # the entropy where a non-target class dominates (held to docs/numerics.md's bound), and where
    # the target does (relative)
    "entropy_dominant_classes": Case(seed=45, entry="logits", lead=(31,), v=64, entropy=True,
                                     reduction="none", confident=30.0),
    "entropy_dominant_classes_composite": Case(seed=45, entry="logits", lead=(31,), v=64,
                                               entropy=True, reduction="none", confident=30.0,
                                               class_weight=True, label_smoothing=0.1),
    # the CUDA backend's fp16 tile scale came from |a| ~ g rather than the row's largest
    # probability: a chunk of confident rows had its whole gradient flushed below fp16's
    # subnormals (dW exactly 0 where float64 says 1e-13)
    "fp16_tile_scale_of_confident_rows": Case(seed=1951611620, backend="cuda-host", lead=(1,),
                                              v=2, d=1, dtype="fp16", master=True,
                                              reduction="sum", softcap=30.0, confident=150.0),
    # (the bound's own completeness) a saturated softcap whose derivative rounds to 2^-23, not
    # 0, times a tile error where float64's gradient is exactly 0 (one class, smoothing)
    "saturated_softcap_chain": Case(seed=186189157, backend="cuda-host", entry="logits",
                                    lead=(1,), v=1, reduction="sum", label_smoothing=0.1,
                                    softcap=3.0, temperature=1.7, confident=150.0),
    # (the bound's own completeness) the composite path's entropy at margin ~88, where
    # q = 1 - p_t is below fp32's normal range and multiplies softplus(z_t - lse_x) ~ 88
    "entropy_with_subnormal_q": Case(seed=1583597821, backend="cuda-host", entry="logits",
                                     lead=(16,), v=2, class_weight=True, reduction="sum",
                                     label_smoothing=0.5, temperature=1.7, entropy=True,
                                     confident=150.0),
    "fp16_tile_scale_two_rows": Case(seed=117229546, backend="cuda-host", lead=(2,), v=5, d=12,
                                     dtype="fp16", master=True, reduction="sum", confident=20.0),
    # class weights with label smoothing as a fused target distribution, every token ignored:
    # the mean's upstream 1/0 times the rows' zero target mass made the gradients NaN where
    # they are 0 (soft_row_grad now takes g = 0 for a row without target or z-loss weight)
    "distribution_all_ignored": Case(seed=620862316, lead=(1,), v=1, d=1, class_weight=True,
                                     ignore=1.0, label_smoothing=0.1),
    "distribution_all_ignored_logits": Case(seed=792036520, entry="logits", lead=(1,), v=1,
                                            class_weight=True, ignore=1.0,
                                            label_smoothing=0.5),
    # fp32 master weights on the composite path (class weights with label smoothing on the CUDA
    # backend without FLCE_CUDA_OPT_IN=distributions): the weight's cast to the inputs' dtype rounded
    # its gradient to bf16 on the way back (172x the bound)
    "composite_master_weights": Case(seed=665116219, backend="cuda-host", lead=(1,), v=1, d=1,
                                     dtype="bf16", master=True, class_weight=True,
                                     reduction="sum", label_smoothing=0.5, z_loss=0.1),
    # (the bound's own completeness) a target distribution's pivot entry -g Y q_a + g y_rest
    # cancels to ~Y/200 of its terms: their fp32 roundings (~1e-7, 5x the bound then) are
    # absolute there. A probability target (pivot = target's largest class), and class
    # weights with label smoothing on the CPU's soft ops where the pivot is not the class
    "soft_pivot_cancellation": Case(seed=197624601, entry="logits", lead=(64,), v=400,
                                    class_weight=True, reduction="sum", scale=0.5, soft="sharp"),
    "distribution_pivot_cancellation": Case(seed=510952423, entry="logits", lead=(62,), v=400,
                                            class_weight=True, reduction="none",
                                            label_smoothing=0.1, scale=0.5),
    # (issue 51) the fused soft ops formed a pivot that is not the target, dz_a = g (Y p_a - y_a)
    # with p_a ~ 1e-3, as -g Y q_a + g y_rest from terms of g Y: 1e-4 relative off at V = 32000
    # (Liger's test_correctness_with_weight_with_other_params_once), 7-10x the bound here, which
    # now holds the fused ops to a few roundings of the smaller form's terms
    "pivot_class_weights_smoothing": Case(seed=51, entry="logits", lead=(16,), v=16000,
                                          class_weight=True, label_smoothing=0.1,
                                          reduction="sum"),
    "pivot_class_weights_smoothing_linear": Case(seed=52, lead=(16,), v=16000,
                                                 class_weight=True, label_smoothing=0.1,
                                                 reduction="sum"),
    "pivot_probabilities_class_weights": Case(seed=53, entry="logits", lead=(16,), v=16000,
                                              class_weight=True, reduction="sum", soft="dense"),
    "pivot_class_weights_smoothing_cuda": Case(seed=54, backend="cuda-host", entry="logits",
                                               lead=(16,), v=1000, class_weight=True,
                                               label_smoothing=0.1, reduction="sum",
                                               cuda_distributions=True),
    # (issue 51) class weights with label smoothing, "mean", every present target's weight 0:
    # the smoothing's terms over a zero sum of weights gave inf where torch's mean is NaN
    "zero_target_weights_mean": Case(seed=55, entry="logits", lead=(16,), v=64,
                                     class_weight=True, label_smoothing=0.1, ignore=0.2,
                                     zero_weights=True),
    "zero_target_weights_mean_linear": Case(seed=56, lead=(16,), v=64, bias=True,
                                            class_weight=True, label_smoothing=0.1, ignore=0.2,
                                            zero_weights=True),
    "zero_target_weights_mean_cuda": Case(seed=58, backend="cuda-host", entry="logits",
                                          lead=(9,), v=33, class_weight=True,
                                          label_smoothing=0.1, ignore=0.2, zero_weights=True,
                                          cuda_distributions=True),
    # (the bound's own completeness) a bf16 GEMM that multiplies bf16 natively (AVX512-BF16,
    # AMX) flushes a subnormal product to 0: a dW element of -3.5e-39 (one row) came out 0
    "bf16_gemm_flushes_subnormal_products": Case(seed=1123681288, lead=(1,), v=13, d=40,
                                                 dtype="bf16", reduction="sum", temperature=1.7,
                                                 entropy=True, exact_bf16_grad=False,
                                                 confident=150.0),
    # (the bound's own completeness) distillation: an fp32 loss below fp32's subnormals (2e-59
    # at margin 150), an fp16 weight gradient below fp16's (2e-27)
    "distill_loss_below_subnormals": Case(seed=1382239370, entry="distill", lead=(3, 16), v=3,
                                          d=24, dtype="bf16", reduction="none", confident=150.0,
                                          scale=4.0, beta=0.9, soft_weight=0.5, d_teacher=8),
    # (the bound's own completeness) fp32 logit gradients below fp32's normal range, whose
    # subnormal P_j multiply r_j - KL ~ 90: dW of 5e-43 off by 2e-43
    "distill_subnormal_gradients": Case(seed=1480289748, entry="distill", lead=(16,), v=400,
                                        d=64, bias=True, ignore=0.2, reduction="sum",
                                        temperature=1.7, confident=150.0, w_layout="strided",
                                        divergence="reverse_kl", hard_weight=0.5, d_teacher=8,
                                        same_class=False),
    "distill_fp16_grad_below_subnormals": Case(seed=877547840, entry="distill", lead=(1, 7),
                                               v=3, d=8, dtype="fp16", reduction="none",
                                               temperature=0.5, confident=60.0, scale=4.0,
                                               x_layout="strided", beta=1.0, hard_weight=1.0,
                                               d_teacher=8, teacher_grad=True,
                                               same_class=False),
}


@pytest.mark.parametrize("name", [
    pytest.param(k, marks=pytest.mark.cuda_host) if c.backend == "cuda-host" else k
    for k, c in REGRESSIONS.items()])
def test_regression(name):
    # (cuda-host cases: conftest.py builds the emulation, or skips or fails as it says)
    assert fuzz.check(REGRESSIONS[name]) is None


# Planted errors the bounds must catch, each on a case where it is a real defect.
def _planted(key, fn):
    def run(c, inputs):
        got = _RUN(c, inputs)
        if key in got:
            got[key] = fn(got[key])
        return got
    return run


_RUN = fuzz.run_flce
PLANTED = {
    # a loss 1e-5 high, in fp32 (a few hundred ulps)
    "loss_scaled": (Case(seed=7, lead=(33,), v=129, d=40), "loss",
                    lambda x: x * (1 + 1e-5)),
    # the textbook lse - z_t: at margin 60 the loss rounds to 0 in fp32
    "collapsed_loss": (Case(seed=8, lead=(16,), v=64, d=16, reduction="none", confident=60.0),
                       "loss", lambda x: torch.where(x < 1e-6, torch.zeros_like(x), x)),
    # one gradient element off by 1e-3 of the row's largest
    "dinput_element": (Case(seed=9, lead=(16,), v=100, d=24), "dinput",
                       lambda x: x.index_put_((torch.tensor([3]), torch.tensor([5])),
                                              x[3].abs().max() * 1e-3, accumulate=True)),
    # dW 2 ulps of bf16 off (the tile rounded twice)
    "dweight_bf16": (Case(seed=10, lead=(31,), v=64, d=16, dtype="bf16"), "dweight",
                     lambda x: x * (1 + 2 * 2 ** -7)),
    # the entropy 1e-4 off where the target dominates
    "entropy_scaled": (Case(seed=11, entry="logits", lead=(16,), v=64, entropy=True,
                            reduction="none", confident=20.0), "entropy",
                       lambda x: x * (1 + 1e-4)),
    # the lse 1e-4 off (some 200 fp32 ulps of an lse of ~4)
    "lse_shifted": (Case(seed=12, lead=(16,), v=64, d=16, lse=True, reduction="none"), "lse",
                    lambda x: x + 1e-4),
    # probability targets: the target gradient -log p_c as torch's lse - z_c, which rounds to 0
    # in fp32 for the dominant class at margin 60 (float64: ~1e-24)
    "soft_target_grad_collapsed": (Case(seed=14, lead=(16,), v=64, d=16, reduction="none",
                                        confident=60.0, soft="onehot", soft_grad=True),
                                   "dtarget",
                                   lambda x: torch.where(x.abs() < 1e-6, torch.zeros_like(x), x)),
    # the soft loss as lse - sum_c y_c z_c: 0 where a sharp target sits on the dominant class
    "soft_loss_collapsed": (Case(seed=15, entry="logits", lead=(16,), v=64, reduction="none",
                                 confident=60.0, soft="sharp"), "loss",
                            lambda x: torch.where(x < 1e-6, torch.zeros_like(x), x)),
    # the soft target gradient 1e-5 off (bf16 logits, fp32 targets: some 100 fp32 ulps)
    "soft_target_grad_scaled": (Case(seed=16, entry="logits", lead=(16,), v=64, dtype="bf16",
                                     soft="dense", soft_grad=True), "dtarget",
                                lambda x: x * (1 + 1e-5)),
    # distillation: a forward KL ~1 off by 1e-4 (the bound, the worst case of the GEMMs'
    # roundings through the logit gradient as above, is ~1e-5 of it); the textbook F.kl_div of
    # log_softmax, 0 where both models put 1 - 1e-26 on one class; one student gradient element
    # off by 1e-3 of its row's largest; the teacher's bf16 weight gradient 2 ulps off
    "distill_loss_scaled": (Case(seed=60, entry="distill", lead=(16,), v=64, d=16,
                                 reduction="none", divergence="forward_kl"), "loss",
                            lambda x: x * (1 + 1e-4)),
    "distill_collapsed_loss": (Case(seed=61, entry="distill", lead=(16,), v=64, d=16,
                                    reduction="none", confident=60.0, divergence="forward_kl"),
                               "loss", lambda x: torch.where(x < 1e-6, torch.zeros_like(x), x)),
    "distill_dinput_element": (Case(seed=62, entry="distill", lead=(16,), v=100, d=24,
                                    divergence="reverse_kl", hard_weight=0.5), "ds_input",
                               lambda x: x.index_put_((torch.tensor([3]), torch.tensor([5])),
                                                      x[3].abs().max() * 1e-3,
                                                      accumulate=True)),
    "distill_teacher_dweight_bf16": (Case(seed=63, entry="distill", lead=(31,), v=64, d=16,
                                          dtype="bf16", teacher_grad=True, beta=0.3),
                                     "dt_weight", lambda x: x * (1 + 2 * 2 ** -7)),
}


@pytest.mark.parametrize("name", list(PLANTED))
def test_bounds_catch_planted_errors(name, monkeypatch):
    case, key, fn = PLANTED[name]
    assert fuzz.check(case) is None, "the unplanted case must pass"
    monkeypatch.setattr(fuzz, "run_flce", _planted(key, fn))
    why = fuzz.check(case)
    assert why is not None and why.startswith(key), why


def test_shrink_finds_a_minimal_case(monkeypatch):
    """A planted bias-gradient error shrinks to a case that still has a bias and nothing else it
    does not need."""
    monkeypatch.setattr(fuzz, "run_flce", _planted("dbias", lambda x: x + 1e-3))
    big = Case(seed=13, lead=(2, 9), v=100, d=24, bias=True, label_smoothing=0.1, softcap=30.0,
               x_layout="strided", reduction="none")
    assert fuzz.check(big) is not None
    small = fuzz.shrink(big, budget_s=30)
    assert fuzz.check(small) is not None and small.bias
    assert (small.label_smoothing, small.softcap, small.x_layout) == (0.0, 0.0, "plain")
    assert small.lead[-1] <= 5 and small.v <= 50 and len(small.lead) == 1
    assert "Case(seed=13" in fuzz.repro(small, "x")


def test_cases_cover_the_options():
    """The draws of the short run reach every option and layout (a fuzzer that never drew one
    would say nothing about it)."""
    import random

    seen = {f.name: set() for f in dataclasses.fields(Case)}
    for backend in SHORT_RUN:
        rng = random.Random(f"{backend}-0")
        for _ in range(SHORT_RUN[backend]):
            c = fuzz.draw(rng, backend)
            for f in seen:
                seen[f].add(repr(getattr(c, f)))
    for f, want in {"entry": 3, "dtype": 3, "master": 2, "bias": 2, "class_weight": 2,
                    "reduction": 3, "single_pass": 3, "x_layout": 3, "w_layout": 4,
                    "t_layout": 2, "class_dim": 2, "lse": 2, "entropy": 2, "softcap": 3,
                    "temperature": 3, "confident": 4, "ignore": 3, "soft": 5, "soft_dtype": 3,
                    "soft_grad": 2, "cuda_distributions": 2, "divergence": 3, "beta": 4,
                    "hard_weight": 3, "soft_weight": 3, "d_teacher": 3, "teacher_grad": 2,
                    "same_class": 2}.items():
        assert len(seen[f]) >= want, (f, seen[f])
