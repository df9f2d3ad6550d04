"""
Results tables (tools/results.py): paired on the same questions; committed runs load and their
tables are what the command writes.
"""
import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

import rollout
from domains import searchqa
from harness_search import harness_archive
from rundir import report
from rundir import run_reader
from tools import results
from tests.helpers import ROOT, copy_run


# ---- results tables: paired on the same questions ----------------------------------------------

def test_mean_at_k_and_paired_gain_on_hand_made_scores():
    before = [dict(example_id=i, score=float(j < i % 4)) for i in range(40) for j in range(4)]  # 0, .25, .5, .75
    after = [dict(example_id=i, score=float(j <= i % 4)) for i in range(40) for j in range(4)]  # each +.25
    assert rollout.mean_at_k(before)[0] == 0.375 and rollout.mean_at_k(after)[0] == 0.625
    a, b = rollout.per_example_means(before), rollout.per_example_means(after)
    gain, se = rollout.paired_gain(a, b)
    assert gain == 0.25 and se == 0.0                 # the same shift on every question: no paired noise
    assert rollout.mean_at_k(before)[1] > 0.04        # while each side alone has a sizeable SE
    del b[0]
    assert rollout.paired_gain(a, b)[0] == 0.25       # only questions scored on both sides count


@pytest.mark.slow
def test_results_tables_come_from_the_summaries(tiny_reference, tmp_path):
    s = json.loads((tiny_reference / "summary.json").read_text())
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "results.py"), str(tiny_reference.parent), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    row = next(x for x in (tmp_path / "RESULTS.md").read_text().splitlines() if x.startswith("| searchqa | whale |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2:5] == ["1", str(s["test_examples"]), f"{100 * s['test_mean8_final']:.1f}"]
    assert cells[5] == f"{100 * s['test_gain']:+.1f} ± {100 * s['test_gain_se']:.1f} (SE)"
    assert (tmp_path / "curve_searchqa.png").stat().st_size > 0
    # without --out the tables go beside the runs (never into the repository's results/)
    grid = tmp_path / "grid"
    copy_run(tiny_reference, grid / "tiny")
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "results.py"), str(grid)], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 0 and (grid / "RESULTS.md").exists() and not (tmp_path / "results").exists(), r.stderr
    for flag, typo in (("--domains", "serchqa"), ("--methods", "whale-adaptve")):  # a typo: refused, one line
        r = subprocess.run([sys.executable, str(ROOT / "tools" / "results.py"), str(grid), flag, typo], capture_output=True,
                           text=True, timeout=300, cwd=tmp_path)
        assert r.returncode == 1 and r.stderr.count("\n") == 1 and f"{flag}: no " in r.stderr, r.stderr


def test_results_claims_pair_methods_on_the_same_questions():
    def run(method, seed, scores, schedule="fixed-steps:4,3"):
        final = {"event": "eval", "split": "test", "tag": "final", "rollouts": 100, "per_example": dict(enumerate(scores))}
        return {"cfg": {"domain": "d", "method": method, "seed": seed, "schedule": schedule},
                "sum": {"rollouts": 100, "seconds": 60}, "metrics": [final]}
    runs = [run("whale", 0, [1, 0.5, 0, 0]), run("weight-only", 0, [0, 0.5, 0, 0.5]),
            run("stagewise", 0, [0, 0, 0, 0])]
    results.cell_labels(runs)
    rows = {r.split("|")[3].strip(): r for r in results.claims(runs).splitlines()[2:]}
    assert set(rows) == {"weight-only", "stagewise"}  # harness-only, fst, adaptive: no runs, no row
    # whale - weight-only per question: +1, 0, 0, -0.5 -> mean 0.125, sample sd 0.6292, SE 0.3146
    assert "+12.5 ± 31.5 (SE, 4 questions, 0.4 SE)" in rows["weight-only"]
    assert "+37.5 ± 23.9 (SE, 4 questions" in rows["stagewise"]
    runs += [run("whale", 1, [1, 1, 0, 0]), run("weight-only", 1, [0, 0, 0, 0])]  # second seed: +50
    results.cell_labels(runs)
    row = next(r for r in results.claims(runs).splitlines() if "| weight-only |" in r)
    # t(1 df) x sd of (12.5, 50) points / sqrt(2 seeds): 12.706 x (37.5 / sqrt 2) / sqrt 2 = 238.2, wider than
    # the questions' interval: seed-averaged differences 1, .5, 0, -.25 -> t(3 df) 3.182 x SE 27.7 = 88.2
    assert "| 2 | +31.2 ± 238.2 (95% CI, the wider of: over 2 seeds ± 238.2, over 4 questions ± 88.2)" in row
    # two seeds that agree exactly: the t interval over seeds is ± 0; the questions' (3.182 x SE 25 = 79.55) decides
    same = [run("whale", s, [1, 0, 0, 0]) for s in (0, 1)] + [run("stagewise", s, [0, 0, 0, 0]) for s in (0, 1)]
    results.cell_labels(same)
    row = next(r for r in results.claims(same).splitlines() if "| stagewise |" in r)
    assert "+25.0 ± 79.5 (95% CI, the wider of: over 2 seeds ± 0.0, over 4 questions ± 79.5) | unresolved" in row


def test_results_adaptive_claim_has_its_margin_and_peak_table_pairs_seeds():
    """'adaptive at least matches fixed' holds above -2 points (the margin registered before its cells),
    not above 0; the peak table is where each method's curve first reaches the same seed's
    weight-only peak (not its final), or says that it never does."""
    def run(method, seed, points, schedule="fixed-steps:4,3"):
        evals = [{"event": "eval", "split": "test", "tag": "final" if x == 300 else "curve", "rollouts": x,
                  "mean": sum(v) / len(v), "per_example": dict(enumerate(v))} for x, v in points]
        return {"cfg": {"domain": "d", "method": method, "seed": seed, "schedule": schedule, "test_subset": 0},
                "sum": {"rollouts": 300, "seconds": 60}, "metrics": evals}
    q = lambda k: [1.0] * k + [0.0] * (10 - k)  # k of 10 questions right
    runs = [run("weight-only", 0, [(0, q(0)), (100, q(6)), (300, q(4))]),  # peak 60 % at 100, final 40 %
            run("whale", 0, [(0, q(0)), (100, q(5)), (200, q(6)), (300, q(6))]),
            run("harness-only", 0, [(0, q(0)), (300, q(5))]),
            run("whale", 0, [(0, q(0)), (300, q(5))], "adaptive:w=2")]  # 1 question below whale's final
    results.cell_labels(runs)
    row = next(r for r in results.claims(runs).splitlines() if "| whale-adaptive | whale |" in r)
    assert "| -10.0 ± 10.0 (SE, 10 questions, -1.0 SE) |" in row and "| unresolved (95% interval holds -2) |" in row
    assert results.verdict(-1.0, 0.5, 2) == "holds" and results.verdict(-1.0, 0.5) == "reversed"
    assert results.verdict(-3.0, 0.5, 2) == "reversed"
    # adaptive against the single sides: in RESULTS.md, marked as added after the registration; not in the README
    assert "| whale-adaptive | weight-only | adaptive joint beats weights alone (added, not registered) |" in \
        results.claims(runs)
    assert "not registered" not in results.claims(runs, compact=True)
    peak = {r.split("|")[3].strip(): r for r in results.to_peak(runs).splitlines()[2:]}
    assert peak["whale"] == "| d | 60.0 | whale | 200 | 67% | 1/1 |"  # the peak (60), not the final (40)
    assert peak["weight-only"].endswith("| weight-only | 100 | 33% | 1/1 |")
    assert peak["harness-only"].endswith("| not reached | - | 0/1 |")


def test_results_phases_are_read_in_order_with_the_harness_share_of_rollouts(tmp_path):
    """A run's schedule is read from its events, not its flags: an adaptive run that cut its phases
    short shows the phases it actually had, and evaluations and resumes spend nothing."""
    def record(name, events):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        return tmp_path / name
    step = lambda x: {"event": "rollout_step", "cycle": 0, "rollouts": x}
    iteration = lambda i, x: {"event": "harness_iteration", "cycle": 0, "iteration": i, "rollouts": x}
    events = [{"event": "eval", "split": "val", "tag": "initial", "rollouts": 0}, step(100), step(200),
              {"event": "harness_candidate", "cycle": 0, "cand": "cand_000", "rollouts": 250}, iteration(0, 250),
              {"event": "start", "rollouts": 250}, iteration(1, 400), step(500)]
    runs = [{"cfg": {"domain": "d", "method": "whale", "seed": 0, "schedule": "adaptive:w=2"}, "record": record("a", events)},
            {"cfg": {"domain": "d", "method": "whale", "seed": 1, "schedule": "adaptive:w=2"},
             "record": record("b", [step(100)])}]
    assert results.phases(runs[0]) == ("A2 B1 A1", 0.4)  # the incoming harness's re-scoring is not an iteration
    results.cell_labels(runs)
    assert results.phases_table(runs).splitlines()[2] == "| d | whale-adaptive | 0 1 | A2 B1 A1 / A1 | 40% / 0% |"


def test_results_against_pairs_the_same_cells_of_two_grids():
    """--against (a rerun of a grid's cells with a changed proposer): each cell of this grid minus the
    same cell of the other, per seed on the same questions; a cell or seed only one grid has is left out."""
    def run(method, seed, scores, rollouts=100):
        final = {"event": "eval", "split": "test", "tag": "final", "per_example": dict(enumerate(scores))}
        return {"cfg": {"domain": "d", "method": method, "seed": seed, "schedule": "fixed-steps:4,3"},
                "sum": {"rollouts": rollouts, "seconds": 60, "test_mean8_final": sum(scores) / len(scores)},
                "metrics": [final]}
    new = [run("harness-only", 0, [1, 0.5, 0, 0], 128), run("harness-only", 2, [1, 1, 1, 1]), run("whale", 0, [1] * 4)]
    old = [run("harness-only", 0, [0, 0.5, 0, 0.5], 96), run("harness-only", 1, [0] * 4)]
    results.cell_labels(new), results.cell_labels(old)
    rows = results.against(new, old, "runs/new", "runs/old").splitlines()
    assert rows[0].startswith("| domain | method | seeds | old | new | new - old (points) |")
    assert len(rows) == 3  # one cell in both grids (whale is only in new); seed 0 only (1 and 2 are unpaired)
    # per question +1, 0, 0, -0.5: +12.5 +- 31.5 (SE), as the claims compute it
    assert "| d | harness-only | 0 | 25.0 | 37.5 | +12.5 ± 31.5 (SE, 4 questions, 0.4 SE) | unresolved" in rows[2]
    assert rows[2].endswith("| 96 / 128 | none |")  # the same settings (config.json) and commits
    old[0]["cfg"]["temperature"] = 0.3
    old[0]["metrics"].append({"event": "start", "commit": "abc"})
    assert results.against(new, old, "runs/new", "runs/old").splitlines()[2].endswith(
        "| 96 / 128 | temperature 0.3 / -; commit abc / ? |")  # where the settings and commits differ
    other = [run("weight-only", 0, [0] * 4)]
    results.cell_labels(other)
    assert results.against(new, other, "a", "b") == ""  # nothing in common: no table


@pytest.mark.slow
def test_a_packed_run_reads_as_the_run_it_was(tmp_path):
    """results.py --pack turns a finished run into run.zip + report.html (a committed grid's run is
    two files); results.py, report.py and unpacked_archive read it as they read the folder, an older
    archive.zip goes in under archive/, packing twice gives the same bytes, a running run stays."""
    src = ROOT / "results" / "runs" / "cpu-long-typed" / "searchqa-harness-only-s0"
    run = tmp_path / "grid" / "s0"
    run.mkdir(parents=True)
    with zipfile.ZipFile(src / "run.zip") as z:  # the committed run, unpacked, its archive as the older archive.zip
        z.extractall(run)
    harness_archive._write_zip(str(run / "archive.zip"), harness_archive._files(str(run / "archive"), ""))
    shutil.rmtree(run / "archive")
    (run / "report.html").write_text("page")
    before = results.load(tmp_path / "grid")
    running = tmp_path / "grid" / "s1"
    shutil.copytree(run, running)
    (running / "summary.json").unlink()
    r = subprocess.run([sys.executable, "tools/results.py", str(tmp_path / "grid"), "--pack"], capture_output=True,
                       text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0 and r.stdout.count("/run.zip") == 1, r.stderr
    assert sorted(p.name for p in run.iterdir()) == ["report.html", "run.zip"]
    assert (running / "config.json").exists() and not (running / "run.zip").exists()  # not finished: not packed
    after = results.load(tmp_path / "grid")
    assert [(a["cfg"], a["sum"], a["metrics"]) for a in after] == [(b["cfg"], b["sum"], b["metrics"]) for b in before]
    with zipfile.ZipFile(run / "run.zip") as z, zipfile.ZipFile(src / "run.zip") as committed:
        assert sorted(z.namelist()) == sorted(committed.namelist())
        assert all(z.read(n) == committed.read(n) for n in z.namelist())
    assert (run / "run.zip").read_bytes() == (src / "run.zip").read_bytes()  # names sorted, times fixed
    folder = harness_archive.unpacked_archive(run)
    assert "phase00" in os.listdir(folder) and run_reader.read_run(run)["phases"][0]["candidates"]
    assert run_reader.find_runs(tmp_path / "grid") == [run, running] and run_reader.read_run(run)["config"]["seed"] == 0


def test_results_against_two_grids_gives_a_table_each(tmp_path):
    """--against twice (cpu-long-typed against cpu-long and against cpu-long-vote, its parent grid):
    one table per grid, on committed runs, and the command line in the page rebuilds both."""
    r = subprocess.run([sys.executable, "tools/results.py", "results/runs/cpu-long-vote", "--out", str(tmp_path),
                        "--against", "results/runs/cpu-long", "--against", "results/runs/cpu-long-look",
                        "--domains", "searchqa", "--methods", "harness-only"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    page = (tmp_path / "RESULTS.md").read_text()
    assert "--against results/runs/cpu-long --against results/runs/cpu-long-look" in page
    for other in ("cpu-long", "cpu-long-look"):
        assert page.count(f"### Against results/runs/{other}\n") == 1
        assert "| searchqa | harness-only | 0, 1, 2 | " in page and f"| cpu-long-vote - {other} (points) |" in page


def test_results_verdicts_curves_and_coverage_use_the_same_questions(tmp_path):
    ids = [e["id"] for e in searchqa.load_split("test")[:4]]  # four test questions; the curves use test[:2]

    def run(method, seed, initial, subset_means, final):
        ev = lambda split, tag, x, **k: {"event": "eval", "split": split, "tag": tag, "rollouts": x, **k}
        metrics = [ev("test", "initial", 0, per_example=dict(zip(ids, initial)), mean=sum(initial) / 4)]
        metrics += [ev("test_subset", f"A{i}", 100 * (i + 1), mean=y) for i, y in enumerate(subset_means)]
        metrics += [ev("test", "final", 400, per_example=dict(zip(ids, final)), mean=sum(final) / 4)]
        return {"cfg": {"domain": "searchqa", "method": method, "seed": seed, "schedule": "fixed-steps:4,3",
                        "test_subset": 2}, "sum": {"rollouts": 400, "seconds": 60}, "metrics": metrics}
    whale = run("whale", 0, [0, 0, 0, 0], [0.25, 0.5, 0.75], [0.75, 0.75, 0, 0])
    stage = run("stagewise", 0, [0, 0, 0, 0], [0, 0, 0], [0.5, 0, 1, 1])  # on test[:2]: 0.25; on all four: 0.625
    assert results.curve(whale) == [(0, 0.0), (100, 0.25), (200, 0.5), (300, 0.75), (400, 0.75)]
    assert results.reaches(whale, stage) == 100  # the subset's first point >= stagewise's 0.25 on test[:2]
    assert results.reaches(stage, whale) is None  # stagewise's curve never reaches whale's 0.75
    harness, weight = run("harness-only", 0, [0] * 4, [], [1, 1, 1, 1]), run("weight-only", 0, [0] * 4, [], [0] * 4)
    runs = [whale, stage, harness, weight]
    results.cell_labels(runs)
    rows = {tuple(c.strip() for c in r.split("|")[2:4]): r for r in results.claims(runs).splitlines()[2:]}
    # whale - stagewise per question: +0.25, +0.75, -1, -1 -> -25 +- 44.5 points (SE): the interval holds 0
    assert "| unresolved (95% interval holds 0) | 25% of A's rollouts |" in rows["whale", "stagewise"]
    # whale - harness-only: -0.25, -0.25, -1, -1 -> -62.5 +- 21.7 (SE); 1.96 SE = 42.4 < 62.5
    assert "| -62.5 ± 21.7 (SE, 4 questions, -2.9 SE) | reversed | not reached |" in rows["whale", "harness-only"]
    assert "| holds |" in rows["harness-only", "weight-only"]  # +100 +- 0: searchqa's bottleneck claim
    # weight-only ends at 0 = harness-only's initial score: reached before the first rollout, said so
    assert "| at the start (B's final is no better than the initial score) |" in rows["harness-only", "weight-only"]
    assert ("weight-only", "harness-only") not in rows  # the weights-first claim is math's
    (tmp_path / "unfinished").mkdir()
    (tmp_path / "unfinished" / "config.json").write_text("{}")
    text = results.coverage(runs, tmp_path)
    assert text.startswith("4 of 54 runs") and "| searchqa | s0 | - | s0 | s0 | - | s0 |" in text
    assert "unfinished" in text  # a run to resume is named
    # a smaller grid (run_all.sh cpu-long passes its own): the count and the columns are that grid's
    text = results.coverage(runs, tmp_path, domains=["searchqa"], methods=["whale", "harness-only", "fst"])
    assert text.startswith("2 of 9 runs") and "| searchqa | s0 | s0 | - |" in text and "math" not in text


@pytest.mark.slow
def test_whale_and_the_results_tools_import_without_torch():
    # results.py and report.py read run directories (on a laptop, in CI) without the training stack:
    # whale.py imports torch only in main(), so importing it for Args and METHODS stays light
    code = "import sys, whale; from tools import results; from rundir import report; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr[-2000:])


@pytest.mark.slow
def test_race_replay_reads_every_committed_search_and_ends_with_its_totals():
    """tools/race_replay.py over a committed grid: the decisions and rollouts of every search in it,
    the last line exactly `decisions agree A of B, rollouts X of Y` (racing spends no more than the
    full evaluation, and the conservative SPRT agrees everywhere on it)."""
    import re
    for args in ([], ["--rule", "sprt"]):
        r = subprocess.run([sys.executable, str(ROOT / "tools" / "race_replay.py"), str(ROOT / "results" / "runs" / "cpu"),
                            *args], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        m = re.fullmatch(r"decisions agree (\d+) of (\d+), rollouts (\d+) of (\d+)", r.stdout.strip().splitlines()[-1])
        assert m, r.stdout[-500:]
        a, b, x, y = map(int, m.groups())
        assert b > 0 and a <= b and x <= y
    assert a == b  # the SPRT at theta1 0.75, beta 0.05 changes no decision of this grid


@pytest.mark.slow
def test_race_replay_scores_each_disagreement_on_validation(tmp_path):
    """--validate N: the search's and racing's harnesses of a disagreement, both scored on N validation
    questions x 8 with the base model, and a tally of the side validation takes before the last line;
    the scores are kept, so a second invocation says the same without running the model."""
    import re
    run = ROOT / "results" / "runs" / "cpu-claim" / "searchqa-harness-only-s1"  # one disagreement, iteration 2
    cmd = [sys.executable, str(ROOT / "tools" / "race_replay.py"), str(run), "--validate", "2",
           "--validate-cache", str(tmp_path / "cache")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert again.stdout == r.stdout and len(list((tmp_path / "cache").iterdir())) == 2  # two harnesses, kept
    assert "loading the base model" in r.stderr and "loading" not in again.stderr  # the model was not needed
    lines = r.stdout.strip().splitlines()
    i = next(k for k, x in enumerate(lines) if "the search kept cand_005, racing cand_003" in x)
    assert re.fullmatch(r"  validation \(2 questions x 8\): cand_005 \d+\.\d%, cand_003 \d+\.\d%, racing - search "
                        r"[+-]\d+\.\d% \+- \d+\.\d%: sides with (racing|search|neither)", lines[i + 1]), lines[i + 1]
    assert re.fullmatch(r"validation sides with racing \d, with the search \d, with neither .* \d", lines[-2])
    assert sum(map(int, re.findall(r" (\d)(?:,|$)", lines[-2]))) == 1  # the one disagreement, counted once
    assert lines[-1].startswith("decisions agree ")


@pytest.mark.slow
def test_reading_path_names_the_files_one_rsft_step_reads_and_runs_through():
    """tools/reading_path.py traces a tiny run: one RSFT step is read in whale.py + rs_sft.py and
    leaves them through named calls (the rollouts among them) for everything else it runs (the
    sampler too), each file with the lines of the functions that ran. (Its harness_phase is the same
    code on another tiny run: left to the tool's users, for CI's minutes.)"""
    import re
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "reading_path.py"), "--phase", "weight_phase"],
                       capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    step = r.stdout
    assert re.match(r"weight_phase: read whale.py \+ rs_sft.py: \d+ functions, \d+ lines; calls out: \d+", step)
    assert re.search(r"^  calls out: rollout\.run$", step, re.M), step
    for f in ("whale.py", "rs_sft.py", "rollout.py", "lm/engine.py"):
        assert re.search(rf"^    {re.escape(f)}: \d+ functions, \d+ lines$", step, re.M), (f, step)
    assert "meta_harness.py" not in step and "harness_phase" not in step

def test_a_runs_minutes_add_up_and_scale_by_the_initial_test(capsys, tmp_path):
    """results/first-run/minutes.py on the committed default run (its run.zip): every part it names
    is in the run's order and inside the run's clock, and the developers'-machine figure is the whole
    scaled by 90.8 s over this run's initial test; a folder that is not a run is one line, exit 2."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("minutes", ROOT / "results" / "first-run" / "minutes.py")
    minutes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(minutes)
    run = run_reader.read_run(ROOT / "results" / "runs" / "default" / "searchqa-whale-s0")
    parts = minutes.minutes(run)
    names = [n for n, _ in parts]
    assert names[:4] == ["initial test", "phase A0", "phase B0", "phase A1"] and "final test" in names
    assert sum(n.startswith("2 x 2") for n in names) == 2  # the run scored both new cells
    whole, initial = parts[-1][1], parts[0][1]
    assert all(s > 0 for _, s in parts) and sum(s for _, s in parts[:-1]) <= whole
    assert minutes.main([str(ROOT / "results" / "runs" / "default" / "searchqa-whale-s0")]) == 0
    assert f"{whole * 90.8 / initial / 60:.1f} min;" in capsys.readouterr().out
    (tmp_path / "metrics.jsonl").write_text('{"t": 1.0, "event": "start"}\n')
    assert minutes.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("minutes.py: error:")
