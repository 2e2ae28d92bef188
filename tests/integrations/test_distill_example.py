"""examples/distill.py --quick: a teacher trained briefly, then a student distilled from it with the
stock recipe (log_softmax + F.kl_div, TRL's generalized JSD) and with flce.linear_distillation,
from the same initialization on the same batches.

The two students differ by rounding alone. At step 1 (equal weights) the two losses differ by the
rounding of each: a mean over tokens of sums over V = 2048 terms p (log p - log m), some of either
sign, in fp32 (measured: 1.3e-7 = 2.2 u, u = 2^-24). The test allows 64 u. After it the gradients'
rounding differences move the weights apart (AdamW), and the difference grows: measured at most
4.1e-7 over the quick config's 20 steps. The test allows 1e-5 over the run."""
import importlib.util
import json
import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("matplotlib")

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "examples")
spec = importlib.util.spec_from_file_location("distill_example",
                                              os.path.join(EXAMPLES, "distill.py"))
distill = importlib.util.module_from_spec(spec)
spec.loader.exec_module(distill)

U = 2.0 ** -24


def test_quick_run(tmp_path):
    records = distill.main(["--quick", "--out-dir", str(tmp_path)])
    stock, got = records
    assert (stock["variant"], got["variant"]) == ("stock", "flce")
    steps = distill.QUICK["steps"]
    assert len(stock["losses"]) == len(got["losses"]) == steps
    assert len(stock["teacher_losses"]) == distill.QUICK["teacher_steps"]
    # The teacher learned (cross-entropy from about log V = 7.6 down), and the student moves
    # toward it.
    assert stock["teacher_losses"][0] > 7 and min(stock["teacher_losses"]) < 6.5
    assert stock["losses"][-1] < 0.6 * stock["losses"][0]
    rel = [abs(a - b) / a for a, b in zip(stock["losses"], got["losses"])]
    assert rel[0] <= 64 * U, rel[0]
    assert max(rel) <= 1e-5, rel
    assert got["peak_mb"] > 0 and stock["peak_mb"] > 0
    saved = [json.loads(line) for line in (tmp_path / "distill.jsonl").read_text().splitlines()]
    assert [r["variant"] for r in saved] == ["stock", "flce"]
    assert saved[1]["config"]["divergence"] == "jsd" and saved[1]["commit"]
    assert (tmp_path / "distill.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stock_divergence_is_trls():
    """The stock recipe is the generalized JSD; at beta 0 and 1 the two KLs (TRL's convention),
    checked against flce's float64 reference on logits of moderate size."""
    import torch

    import flce.reference

    g = torch.Generator().manual_seed(0)
    z_s, z_t = torch.randn(6, 50, generator=g), torch.randn(6, 50, generator=g)
    for beta in (0.0, 0.3, 0.5, 1.0):
        got = distill.stock_divergence(z_s, z_t, beta).mean()
        ref = flce.reference.distillation(z_s.double(), z_t.double(), divergence="jsd",
                                          beta=beta)
        assert float(got) == pytest.approx(float(ref), rel=1e-5), beta


def test_help_and_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        distill.parse_args(["--help"])
    out = capsys.readouterr().out
    assert "--quick" in out and "(default: distill_out)" in out and "--teacher-steps" in out
    with pytest.raises(SystemExit):
        distill.parse_args(["--hidden", "100"])
    assert "--hidden must be a multiple of 64" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        distill.parse_args(["--beta", "2"])
    args = distill.parse_args(["--quick", "--steps", "5"])
    assert args.steps == 5 and args.teacher_steps == distill.QUICK["teacher_steps"]
    assert args.out == os.path.join("distill_out", "distill.jsonl")
