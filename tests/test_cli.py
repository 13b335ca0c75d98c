"""`grpo-kernels demo` (what `make demo` runs) works end to end and checks itself against the reference."""

from grpo_kernels import cli


def test_demo_runs_and_reports_agreement(capsys):
    cli.main(["demo", "--prompts", "256", "--group-size", "8"])
    out = capsys.readouterr().out
    assert "valid mask identical: True" in out
    assert "invalid-group rate p^G + (1-p)^G" in out and "41.12%" in out  # p=0.2, G=4 row of the table
