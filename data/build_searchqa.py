"""Rebuild data/searchqa/ from SQuAD v1.1 dev, byte for byte.

Source: the SQuAD v1.1 dev set (Rajpurkar et al. 2016, CC BY-SA 4.0) as shipped inside the
PyPI sdist bigbench==1.0.0 (member .../squad_shifts/squaddev_v1.1.json). We read the member
with tarfile; bigbench itself is never installed or imported.

Outputs (gzip with mtime=0 and no file name in the header, JSON with sorted keys, so a rebuild
is byte-identical):
  passages.jsonl.gz              every paragraph of the dev set: {"id", "title", "text"}
  {weight,harness,val,test}.jsonl.gz
      {"id", "task": {"question"}, "answer": {"aliases": [gold spans], "passage_id"}}

How the cut is made (why: no gold passage may be shared between the test split and the
training pools, else weight training could memorise test passages):
  1. shuffle the 48 articles with a fixed seed and give whole articles to test, val and
     harness until each has at least as many paragraphs as it needs questions (+ margin);
     every remaining article goes to the weight pool;
  2. inside a split, take questions round-robin over paragraphs (every paragraph's first
     question before any paragraph's second), in a seeded random order, so the small
     splits spread over as many passages as possible.
All 2,067 paragraphs stay in the retrieval pool: the search tool sees every split's passages.

Usage: python data/build_searchqa.py [--src bigbench-1.0.0.tar.gz] [--out data/searchqa]
If --src does not exist, the sdist is fetched with `pip download` into its folder.
"""
import argparse
import gzip
import hashlib
import json
import os
import random
import subprocess
import sys
import tarfile

SDIST_SHA256 = "1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2"
MEMBER = "bigbench-1.0.0/bigbench/benchmark_tasks/squad_shifts/squaddev_v1.1.json"
SEED = 1234
# questions per split; the small splits get whole articles, the weight pool the rest
SIZES = {"test": 250, "val": 100, "harness": 128, "weight": 2000}
MARGIN = 1.2  # small splits take articles until paragraphs >= MARGIN * questions


def fetch_sdist(path):
    if not os.path.exists(path):
        folder = os.path.dirname(os.path.abspath(path))
        print(f"{path} missing: downloading bigbench==1.0.0 sdist (358 MB) into {folder}")
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            "bigbench==1.0.0", "-d", folder], capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"build_searchqa: bigbench-1.0.0 sdist not found: the package index no longer serves bigbench==1.0.0 "
                     "(it answers 'from versions: 0.0.1', 2026-12-06); data/searchqa/ stands as committed "
                     "(data/README.md); with a copy of the sdist (its sha256 is there), pass --src PATH")
        path = os.path.join(folder, "bigbench-1.0.0.tar.gz")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    if h.hexdigest() != SDIST_SHA256:
        sys.exit(f"{path}: sha256 {h.hexdigest()} is not the bigbench-1.0.0 sdist ({SDIST_SHA256})")
    return path


def load_squad(sdist):
    with tarfile.open(sdist) as tar:
        return json.load(tar.extractfile(MEMBER))["data"]


def write_jsonl_gz(path, rows):
    data = "".join(json.dumps(r, sort_keys=True, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
    # filename="" and mtime=0 keep the gzip header free of anything that changes between builds
    with open(path, "wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0, compresslevel=9) as g:
        g.write(data)


def build(articles, out):
    rng = random.Random(SEED)
    passages, questions = [], {}  # questions: article title -> [[example, ...] per paragraph]
    for art in articles:
        title = art["title"].replace("_", " ")
        questions[title] = []
        for i, par in enumerate(art["paragraphs"]):
            pid = f"{art['title']}#{i}"
            passages.append({"id": pid, "title": title, "text": par["context"]})
            qs = []
            for qa in par["qas"]:
                aliases = list(dict.fromkeys(a["text"] for a in qa["answers"]))  # dedupe, keep order
                qs.append({"id": qa["id"], "task": {"question": qa["question"].strip()},
                           "answer": {"aliases": aliases, "passage_id": pid}})
            questions[title].append(qs)

    # 1. whole articles to splits
    titles = list(questions)
    rng.shuffle(titles)
    split_titles = {s: [] for s in SIZES}
    for split in ("test", "val", "harness"):
        while sum(len(questions[t]) for t in split_titles[split]) < MARGIN * SIZES[split]:
            split_titles[split].append(titles.pop(0))
    split_titles["weight"] = titles

    # 2. round-robin over paragraphs inside each split
    os.makedirs(out, exist_ok=True)
    for split, n in SIZES.items():
        ranked = []
        for t in split_titles[split]:
            for qs in questions[t]:
                qs = qs[:]
                rng.shuffle(qs)
                ranked += [(rank, rng.random(), ex) for rank, ex in enumerate(qs)]
        ranked.sort(key=lambda r: r[:2])
        assert len(ranked) >= n, f"{split}: only {len(ranked)} questions"
        rows = [ex for _, _, ex in ranked[:n]]
        rng.shuffle(rows)
        write_jsonl_gz(os.path.join(out, f"{split}.jsonl.gz"), rows)
        print(f"{split:8s} {len(rows):5d} questions, {len({r['answer']['passage_id'] for r in rows}):4d} passages, "
              f"{len(split_titles[split])} articles: {', '.join(sorted(split_titles[split])[:6])}"
              f"{' ...' if len(split_titles[split]) > 6 else ''}")
    write_jsonl_gz(os.path.join(out, "passages.jsonl.gz"), passages)
    print(f"passages {len(passages)}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", default="/tmp/dl/bigbench-1.0.0.tar.gz", help="path of bigbench-1.0.0.tar.gz")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "searchqa"))
    args = ap.parse_args()
    build(load_squad(fetch_sdist(args.src)), args.out)
