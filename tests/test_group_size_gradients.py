"""benchmarks/group_size/gradients.py: the gradient recorder is what an optimizer would use, the SNR estimator is
unbiased enough to find a known signal-to-noise, and the quick path end to end (through the CLI)."""

import csv
import json
import math

import pytest
import torch

from benchmarks.group_size import gradients as gg
from grpo_kernels import cli


def test_snr_finds_a_known_signal_to_noise():
    g = torch.Generator().manual_seed(0)
    d, n = 4000, 40
    mu = torch.randn(d, generator=g)
    mu *= 0.5 * math.sqrt(d) / mu.norm()  # ||mu|| = 0.5 sqrt(d); noise N(0, I): tr Var = d, so SNR = 0.5
    grads = [mu + torch.randn(d, generator=g) for _ in range(n)]
    gram = [[float(a @ b) for b in grads] for a in grads]
    assert gg.snr(gram) == pytest.approx(0.5, rel=0.1)
    # the plug-in ||mean||^2 / tr Var would be biased up by 1/n: sqrt(0.25 + 1/40) = 0.52; pure noise gives ~0
    noise = [torch.randn(d, generator=g) for _ in range(n)]
    assert gg.snr([[float(a @ b) for b in noise] for a in noise]) < 0.1


def test_jackknife_interval_brackets_the_estimate_and_covers_a_known_snr():
    """The interval of the study's shape (5 repeats, 10 gradients) contains the true SNR in most trials and lies on
    both sides of the estimate (a bootstrap over repeats put its lower end at the estimate: duplicated repeats read
    as signal)."""
    g = torch.Generator().manual_seed(1)
    d, repeats, trials, covered = 2000, 5, 40, 0
    for _ in range(trials):
        mu = torch.randn(d, generator=g)
        mu *= 0.5 * math.sqrt(d) / mu.norm()
        grads = [mu + torch.randn(d, generator=g) for _ in range(2 * repeats)]
        gram = [[float(a @ b) for b in grads] for a in grads]
        lo, hi = gg.jackknife_snr(gram)
        point = gg.snr(gram)
        assert 0.0 <= lo < point < hi
        covered += lo <= 0.5 <= hi
    assert covered >= 0.8 * trials
    assert all(math.isnan(v) for v in gg.jackknife_snr([row[:4] for row in gram[:4]]))  # 2 repeats: no interval


def test_recorded_gradient_is_the_one_an_optimizer_would_apply():
    """grpo_step with the recorder leaves the parameters alone, and what it records is exactly the step of SGD with
    lr 1 from the same parameters on the same rollout."""
    from grpo_kernels.train.data.tasks import tiny_model
    from grpo_kernels.train.model.policy import Policy
    from grpo_kernels.train.rollout.batch import Rollout
    from grpo_kernels.train.step import grpo_step

    model = tiny_model(32, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32, seed=3)
    policy = Policy(model)
    g = torch.Generator().manual_seed(1)
    lengths = [5, 3, 7, 4, 6, 2]
    rollout = Rollout(prompt_ids=[torch.randint(3, 32, (4,), generator=g)] * 6,
                      completion_ids=[torch.randint(3, 32, (n,), generator=g) for n in lengths],
                      sampler_logps=[torch.zeros(n) for n in lengths], group_size=3).with_rewards(
                          [1.0, 0.0, 0.5, 0.0, 1.0, 1.0])  # fmt: skip
    before = [p.detach().clone() for p in policy.parameters()]
    kw = dict(loss_options={"loss_type": "dapo"}, temperature=1.0, token_budget=64, grad_clip=None)
    recorder = gg.GradientRecorder(policy.parameters())
    grpo_step(policy, recorder, rollout, **kw)
    assert all(torch.equal(a, p) for a, p in zip(before, policy.parameters(), strict=True))
    (recorded,) = recorder.recorded
    grpo_step(policy, torch.optim.SGD(policy.parameters(), lr=1.0), rollout, **kw)
    applied = torch.cat([(a - p.detach()).flatten() for a, p in zip(before, policy.parameters(), strict=True)])
    assert recorded.float().abs().sum() > 0
    torch.testing.assert_close(recorded.float(), applied, rtol=1e-2, atol=1e-6)  # recorded in bf16


def test_quick_gradient_study_end_to_end_and_report_from_files(tmp_path, capsys):
    args = ["group-size-study", "--model", "tiny", "--gradients", "--group-sizes", "2,4", "--repeats", "2",
            "--prompts-per-step", "3", "--prompts", "16", "--sampler", "hf", "--task", "add", "--sft-steps", "30",
            "--max-new-tokens", "6", "--temperature", "1.0", "--out", str(tmp_path)]  # fmt: skip
    assert cli.main(args) in (None, 0)
    out = tmp_path / "tiny_add_d1"  # <model>_<task>_d<difficulty> for a task other than arith 1
    rows = list(csv.DictReader((out / "gradients.csv").open()))
    assert [(r["G"], r["repeat"]) for r in rows] == [("2", "0"), ("2", "1"), ("4", "0"), ("4", "1")]
    for r in rows:
        assert -1.0 <= float(r["cosine"]) <= 1.0
        assert 0.0 <= float(r["valid_a"]) <= 1.0 and 0.0 <= float(r["reward_b"]) <= 1.0
    gram = json.loads((out / "gradients_gram.json").read_text())["gram"]
    for g in ("2", "4"):
        m = torch.tensor(gram[g], dtype=torch.float64)
        assert m.shape == (4, 4) and torch.allclose(m, m.T)
        assert torch.linalg.eigvalsh(m).min() >= -1e-6 * max(1.0, float(m.diagonal().max()))  # a Gram matrix
        for k, r in enumerate(rows[int(g == "4") * 2 :][:2]):  # the rows' cosines are the Gram's own
            a, b = 2 * k, 2 * k + 1
            cos = m[a, b] / (m[a, a] * m[b, b]).sqrt() if m[a, a] > 0 and m[b, b] > 0 else 0.0
            assert float(r["cosine"]) == pytest.approx(float(cos), abs=1e-6)
    summary = (out / "gradients.md").read_text()
    assert "| 2 | 2 |" in summary and "| 4 | 2 |" in summary
    (out / "gradients.md").unlink()
    again = ["group-size-study", "--model", "tiny", "--task", "add", "--plot-only", "--out", str(tmp_path)]
    assert cli.main(again) in (None, 0)
    assert (out / "gradients.md").read_text() == summary


@pytest.mark.parametrize("bad", [["--group-sizes", "1,4"], ["--group-sizes", "x"], ["--repeats", "1"],
                                 ["--prompts-per-step", "99", "--prompts", "8"]])  # fmt: skip
def test_bad_study_options_are_one_line_errors(tmp_path, bad):
    with pytest.raises(SystemExit) as err:
        cli.main(["group-size-study", "--model", "tiny", "--gradients", "--out", str(tmp_path), *bad])
    assert "--" in str(err.value) and "\n" not in str(err.value)
    assert not any(tmp_path.iterdir())


def test_a_cut_short_study_resumes_after_its_last_finished_g_with_the_same_results(tmp_path, capsys):
    """Each finished G is kept in gradients_partial.json; a rerun skips it and ends with what one uninterrupted run
    gives (every batch has its own seeded stream). A partial file of other arguments is refused."""
    common = dict(prompts_per_step=3, repeats=2, pool=16, sampler="hf", task="add", difficulty=1, temperature=1.0,
                  max_new_tokens=6, seed=0, sft_steps=30)  # fmt: skip
    args = ["group-size-study", "--model", "tiny", "--gradients", "--group-sizes", "2,4", "--repeats", "2",
            "--prompts-per-step", "3", "--prompts", "16", "--sampler", "hf", "--task", "add", "--sft-steps", "30",
            "--max-new-tokens", "6", "--temperature", "1.0"]  # fmt: skip
    cut = tmp_path / "cut" / "tiny_add_d1"
    gg.measure("tiny", group_sizes=(2,), partial=cut / "gradients_partial.json", **common)  # cut short after G = 2
    capsys.readouterr()
    cli.main([*args, "--out", str(tmp_path / "cut")])
    assert "resuming: G = 2 done before" in capsys.readouterr().out
    assert not (cut / "gradients_partial.json").exists()  # removed once the study is complete
    cli.main([*args, "--out", str(tmp_path / "whole")])
    whole = tmp_path / "whole" / "tiny_add_d1"
    key = lambda r: {k: v for k, v in r.items() if not k.endswith("_s")}  # noqa: E731 (times differ)
    assert [key(r) for r in csv.DictReader((cut / "gradients.csv").open())] == [
        key(r) for r in csv.DictReader((whole / "gradients.csv").open())]  # fmt: skip
    gg.measure("tiny", group_sizes=(2,), partial=cut / "gradients_partial.json", **common)
    with pytest.raises(SystemExit, match="was written by a run with other arguments"):
        gg.measure("tiny", group_sizes=(2, 4), partial=cut / "gradients_partial.json", **{**common, "seed": 1})
