"""searchqa_menu: the offline search space of searchqa's harness (the primitives proposer's menu).

Each axis is one top-level name of domains/searchqa_h0.py; each alternative is source that
defines exactly that name, spliced into the current harness in place of the old definition
(harness_source.splice), so the proposer (primitives.py) only ever picks among these strings.
domains/searchqa.py re-exports PRIMITIVES and PROMPT_AXES: the domain's interface is unchanged.
Left out: anything a harness could not write itself; the strings are ordinary harness code,
checked by the same static check and sandbox as any proposer's candidate. How far this menu
takes a harness-only search: results/README.md, "The cpu-long-typed grid".
"""

# Written for a 135M model: short spans copied from the text, forgiving answer parsing,
# more of the passage in view. Functions import what they use, so they splice into any harness.
# Issue 33 added alternatives that reach further (evidence chosen by the question's rare words,
# across passages; whole passages, several; names and numbers weighted in the query; examples
# whose answer is not a question word; answers repaired against the evidence in `run`), each
# written from failures in the harness-split traces of results/runs/cpu-long's harness-only
# archives (quoted in their comments), never from val or test.
# Measured with SmolLM2-135M-Instruct on 48 harness questions, greedy: h0 0/48; h0 with
# SYSTEM_PROMPT[0], USER_TEMPLATE[0], EXAMPLES[0], RETRIEVAL[0], format_passages[0] and
# extract_answer[1] 7/48. Sampled at temperature 1.0 every variant tried got at most 1/48.
PRIMITIVES = {
    "SYSTEM_PROMPT": [
        'SYSTEM_PROMPT = ("You answer questions by copying the answer from the search result. "\n'
        '                 "The answer is a short span of one to five words, copied exactly. Do not explain.")\n',
        'SYSTEM_PROMPT = ("You are a precise reading assistant. Read the passage, find the sentence that answers "\n'
        '                 "the question, and reply with only <answer>the exact words from that sentence</answer>.")\n',
    ],
    "USER_TEMPLATE": [
        # reading-comprehension order: text first, question last, no option to search again
        'USER_TEMPLATE = ("Passage:\\n{passages}\\n\\n"\n'
        '                 "Question: {question}\\n"\n'
        '                 "Answer with a few words copied from the passage, inside <answer></answer>.")\n',
        # question first, so the model reads the passage knowing what to look for
        'USER_TEMPLATE = ("Question: {question}\\n\\n"\n'
        '                 "Search result:\\n{passages}\\n\\n"\n'
        '                 "Copy the words from the search result that answer the question. "\n'
        '                 "Reply as <answer>words</answer>.")\n',
        # evidence first, then the question twice as short as possible: the traces' answers are
        # often the question's own words, so the question comes last, right before the answer
        '''USER_TEMPLATE = ("Text:\\n{passages}\\n\\n"
                 "Question: {question}\\n"
                 "The answer is a few words of the text that are not in the question. "
                 "Copy them inside <answer></answer>.")
''',
    ],
    "EXAMPLES": [
        # more worked examples, of different answer types (a number, a name, a place)
        'EXAMPLES = [\n'
        '    dict(question="How many people live in Paris?",\n'
        '         passages="[1] Paris: Paris is the capital and most populous city of France, with 2.1 million residents.",\n'
        '         answer="2.1 million"),\n'
        '    dict(question="Whose company designed and built the tower?",\n'
        '         passages="[1] Eiffel Tower: The Eiffel Tower is a wrought-iron lattice tower in Paris. It is named after "\n'
        '                  "the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889.",\n'
        '         answer="Gustave Eiffel"),\n'
        '    dict(question="In which mountain range is Mount Everest?",\n'
        '         passages="[1] Mount Everest: Mount Everest is Earth\'s highest mountain above sea level, located in the "\n'
        '                  "Mahalangur Himal sub-range of the Himalayas. Its elevation of 8,849 metres was set in 2020.",\n'
        '         answer="Himalayas"),\n'
        ']\n',
        # one example whose answer sits in the middle of a long passage: copy a span, not a sentence
        'EXAMPLES = [\n'
        '    dict(question="When was the height of Mount Everest last measured?",\n'
        '         passages="[1] Mount Everest: Mount Everest is Earth\'s highest mountain above sea level, located in the "\n'
        '                  "Mahalangur Himal sub-range of the Himalayas. The China-Nepal border runs across its summit "\n'
        '                  "point. Its elevation of 8,848.86 m was most recently established in 2020 by the Chinese and "\n'
        '                  "Nepali authorities. Mount Everest attracts many climbers, including highly experienced "\n'
        '                  "mountaineers.",\n'
        '         answer="2020"),\n'
        ']\n',
        # the answer is never a word of the question, and a date is copied whole: the traces show
        # a 135M reader answering with the question's own subject and cutting dates to the year
        '''EXAMPLES = [
    dict(question="Who designed the bridge over the bay?",
         passages="[1] Harbour bridge: The bridge over the bay was designed by the engineer Anna Berg "
                  "and built by a local company.",
         answer="Anna Berg"),
    dict(question="On what date did the bridge open?",
         passages="[1] Harbour bridge: After four years of work the bridge opened on May 12, 1937, "
                  "with a parade across its deck.",
         answer="May 12, 1937"),
]
''',
    ],
    "make_query": [
        # drop question words and filler: BM25 only needs the content words
        'def make_query(question):\n'
        '    import re\n'
        '    filler = {"what", "which", "who", "whom", "whose", "when", "where", "why", "how", "did", "does", "do",\n'
        '              "is", "was", "were", "are", "many", "much", "name", "called", "kind", "type"}\n'
        '    words = re.findall(r"[\\w\'-]+", question)\n'
        '    return " ".join(w for w in words if w.lower() not in filler) or question\n',
        # as above, and numbers said twice: BM25 counts repeated query terms, and a year or a count
        # is rarely shared by two passages
        'def make_query(question):\n'
        '    import re\n'
        '    filler = {"what", "which", "who", "whom", "whose", "when", "where", "why", "how", "did", "does", "do",\n'
        '              "is", "was", "were", "are", "many", "much", "name", "called", "kind", "type"}\n'
        '    words = [w for w in re.findall(r"[\\w\'-]+", question) if w.lower() not in filler]\n'
        '    numbers = [w for w in words if w[0].isdigit()]\n'
        '    return " ".join(words + numbers) or question\n',
        # content words, and names and numbers said twice: BM25 weighs repeated terms, and a
        # capitalised word or a number (a person, a place, a year) is what few passages share
        '''def make_query(question):
    import re
    filler = {"what", "which", "who", "whom", "whose", "when", "where", "why", "how", "did", "does", "do",
              "is", "was", "were", "are", "many", "much", "name", "called", "kind", "type"}
    words = [w for w in re.findall(r"[\\w'-]+", question) if w.lower() not in filler]
    rare = [w for w in words[1:] if w[0].isupper() or w[0].isdigit()]  # the first word is capitalised anyway
    return " ".join(words + rare) or question
''',
    ],
    "RETRIEVAL": [
        "RETRIEVAL = dict(k=1, max_chars=1000)  # the whole top passage: most paragraphs are < 1000 chars\n",
        "RETRIEVAL = dict(k=3, max_chars=500)  # three passages: the gold one is in the top 3 more often\n",
        "RETRIEVAL = dict(k=2, max_chars=800)\n",
        # whole passages, several of them: with a format_passages that keeps only the evidence
        # sentences, more text to choose from costs the reader nothing
        "RETRIEVAL = dict(k=3, max_chars=2000)\n",
        "RETRIEVAL = dict(k=5, max_chars=2000)\n",
    ],
    "NUDGE": [
        'NUDGE = "Answer now with a short phrase copied from the search result, inside <answer></answer>."\n',
        'NUDGE = "Reply with only <answer>...</answer> and nothing else. The answer is one to five words."\n',
    ],
    "format_passages": [
        # only the sentence of each passage sharing most words with the question: a small model
        # picks the right span far more often from one sentence than from a paragraph
        'def format_passages(question, passages):\n'
        '    import re\n'
        '    q = set(re.findall(r"\\w+", question.lower())) - {"the", "a", "an", "of", "in", "to", "and", "is", "was",\n'
        '                                                       "what", "which", "who", "when", "where", "how", "did"}\n'
        '    lines = []\n'
        '    for line in passages.splitlines():\n'
        '        head, _, text = line.partition(": ")\n'
        '        if not text:  # "No results."\n'
        '            lines.append(line)\n'
        '            continue\n'
        '        sentences = re.split(r"(?<=[.!?])\\s+", text)\n'
        '        best = max(sentences, key=lambda s: len(q & set(re.findall(r"\\w+", s.lower()))))\n'
        '        lines.append(f"{head}: {best}")\n'
        '    return "\\n".join(lines)\n',
        # as above with one sentence either side: keeps what "he" or "it" refers to
        'def format_passages(question, passages):\n'
        '    import re\n'
        '    q = set(re.findall(r"\\w+", question.lower())) - {"the", "a", "an", "of", "in", "to", "and", "is", "was",\n'
        '                                                       "what", "which", "who", "when", "where", "how", "did"}\n'
        '    lines = []\n'
        '    for line in passages.splitlines():\n'
        '        head, _, text = line.partition(": ")\n'
        '        if not text:  # "No results."\n'
        '            lines.append(line)\n'
        '            continue\n'
        '        sentences = re.split(r"(?<=[.!?])\\s+", text)\n'
        '        scores = [len(q & set(re.findall(r"\\w+", s.lower()))) for s in sentences]\n'
        '        i = scores.index(max(scores))\n'
        '        lines.append(f"{head}: " + " ".join(sentences[max(0, i - 1): i + 2]))\n'
        '    return "\\n".join(lines)\n',
        # evidence selection by the question's RARE words: in the traces the one-sentence choice
        # above often picks a sentence that shares the article's subject ("Genghis Khan") with the
        # question but not the word that matters ("paternity"). Words are compared on their first
        # five letters (paternity ~ paternal), a word weighs less the more sentences hold it, and
        # a word of the title, which every sentence is about, counts little
        '''def format_passages(question, passages):
    import math
    import re
    stem = lambda w: w[:5]
    q = {stem(w) for w in re.findall(r"\\w+", question.lower()) if len(w) > 2} - \\
        {"what", "which", "when", "where", "whom", "whose", "how", "the", "and", "did", "does", "was", "were"}
    lines = []
    for line in passages.splitlines():
        head, _, text = line.partition(": ")
        if not text:  # "No results."
            lines.append(line)
            continue
        title = {stem(w) for w in re.findall(r"\\w+", head.lower())}
        sentences = [x for x in re.split(r"(?<=[.!?])\\s+", text) if x.strip()] or [text]
        bags = [{stem(w) for w in re.findall(r"\\w+", x.lower())} for x in sentences]
        weight = lambda w: math.log((1 + len(bags)) / sum(w in b for b in bags)) + (0.2 if w in title else 1.0)
        scores = [sum(weight(w) for w in q & b) for b in bags]
        lines.append(f"{head}: {sentences[scores.index(max(scores))]}")
    return "\\n".join(lines)
''',
        # the same choice across ALL passages: the two best sentences of the whole search result,
        # in score order, so k > 1 widens the net without lengthening what the model reads
        '''def format_passages(question, passages):
    import math
    import re
    stem = lambda w: w[:5]
    q = {stem(w) for w in re.findall(r"\\w+", question.lower()) if len(w) > 2} - \\
        {"what", "which", "when", "where", "whom", "whose", "how", "the", "and", "did", "does", "was", "were"}
    found = []
    for line in passages.splitlines():
        head, _, text = line.partition(": ")
        if text:
            title = head.split("] ", 1)[-1]
            found += [(title, x) for x in re.split(r"(?<=[.!?])\\s+", text) if x.strip()]
    if not found:
        return passages
    bags = [{stem(w) for w in re.findall(r"\\w+", x.lower())} for _, x in found]
    weight = lambda w: math.log((1 + len(bags)) / sum(w in b for b in bags)) + 1.0
    scores = [sum(weight(w) for w in q & b) for b in bags]
    best = sorted(range(len(found)), key=lambda i: -scores[i])[:2]
    return "\\n".join(f"[{n + 1}] {found[i][0]}: {found[i][1]}" for n, i in enumerate(best))
''',
    ],
    "extract_answer": [
        # tagged answer if there is one (closing tag optional), else the first non-empty line;
        # "The answer is" and trailing punctuation removed
        'def extract_answer(reply, question):\n'
        '    import re\n'
        '    m = re.search(r"<answer>(.*?)(?:</answer>|$)", reply, re.DOTALL)\n'
        '    lines = [l.strip() for l in (m.group(1) if m else reply).splitlines() if l.strip()]\n'
        '    if not lines:\n'
        '        return None\n'
        '    answer = re.sub(r"^(the )?(final )?answer( is)?[:\\s]*", "", lines[0], flags=re.IGNORECASE)\n'
        '    return answer.strip(" .\\"\'") or None\n',
        # as above, then words the question already has are trimmed from both ends:
        # "Genghis Khan\'s eldest son Jochi" -> "Jochi" (SQuAD answers rarely repeat the question)
        'def extract_answer(reply, question):\n'
        '    import re\n'
        '    m = re.search(r"<answer>(.*?)(?:</answer>|$)", reply, re.DOTALL)\n'
        '    lines = [l.strip() for l in (m.group(1) if m else reply).splitlines() if l.strip()]\n'
        '    if not lines:\n'
        '        return None\n'
        '    answer = re.sub(r"^(the )?(final )?answer( is)?[:\\s]*", "", lines[0], flags=re.IGNORECASE)\n'
        '    answer = answer.strip(" .\\"\'")\n'
        '    seen = set(re.findall(r"\\w+", question.lower())) | {"the", "a", "an", "is", "was"}\n'
        '    words = answer.split()\n'
        '    known = lambda w: set(re.findall(r"\\w+", w.lower())) <= seen\n'
        '    while words and known(words[0]):\n'
        '        words.pop(0)\n'
        '    while words and known(words[-1]):\n'
        '        words.pop()\n'
        '    return " ".join(words).strip(" ,.") or answer or None\n',
        # as the first, and long answers cut to their first clause and 8 words: gold spans are short
        'def extract_answer(reply, question):\n'
        '    import re\n'
        '    m = re.search(r"<answer>(.*?)(?:</answer>|$)", reply, re.DOTALL)\n'
        '    text = (m.group(1) if m else reply).strip()\n'
        '    text = re.sub(r"^(the )?(final )?answer( is)?[:\\s]*", "", text, flags=re.IGNORECASE)\n'
        '    words = re.split(r"\\n|[.;] |, (?:which|who|and|but) ", text)[0].split()\n'
        '    return " ".join(words[:8]).strip(" \\"\',.") or None\n',
        # as the second, and a reply that repeats a worked example's answer is no answer (the
        # traces show "2.1 million", the Paris example's answer, given to unrelated questions):
        # the harness then nudges for another turn instead of returning it
        '''def extract_answer(reply, question):
    import re
    m = re.search(r"<answer>(.*?)(?:</answer>|$)", reply, re.DOTALL)
    lines = [l.strip() for l in (m.group(1) if m else reply).splitlines() if l.strip()]
    if not lines:
        return None
    answer = re.sub(r"^(the )?(final )?answer( is)?[:\\s]*", "", lines[0], flags=re.IGNORECASE).strip(" .\\"'")
    if answer.lower() in {str(ex.get("answer", "")).lower() for ex in EXAMPLES}:
        return None
    seen = set(re.findall(r"\\w+", question.lower())) | {"the", "a", "an", "is", "was"}
    words = answer.split()
    known = lambda w: set(re.findall(r"\\w+", w.lower())) <= seen
    while words and known(words[0]):
        words.pop(0)
    while words and known(words[-1]):
        words.pop()
    return " ".join(words).strip(" ,.") or answer or None
''',
    ],
    "MAX_TURNS": [
        "MAX_TURNS = 1  # one call: cheapest, and a second turn rarely rescues a small model\n",
        "MAX_TURNS = 3\n",
    ],
    # The loop itself: h0's turns, then the answer checked against the evidence the model saw
    # (answer-span repair). In the traces wrong answers are mostly a span the model did not
    # copy (a number from the worked example, a name cut at an initial: "John D"), the
    # question's own words, or a year where the text has the whole date.
    "run": [
        '''def run(task, llm, tools):
    """h0's loop, then the answer repaired against the evidence shown: a name cut at an initial
    is completed from the text, a year becomes the text's whole date when the question asks for
    a date, and an answer that is not in the text or only repeats the question gets one
    correction turn (kept only if the new answer is in the text)."""
    import re
    question = task["question"]
    shown = []

    def look_up(query):
        text = format_passages(question, tools.search(query, **RETRIEVAL))
        shown.append(text)
        return text

    def norm(x):
        return " ".join(re.findall(r"\\w+", x.lower()))

    def repair(answer):
        evidence = " ".join(line.partition(": ")[2] for text in shown for line in text.splitlines())
        at = evidence.lower().find(answer.lower())
        if at >= 0 and re.search(r"(^|\\s)[A-Z]$", answer):  # "John D" -> "John D. Rockefeller"
            tail = re.match(r"\\.?(?:\\s+[A-Z][\\w'-]*)+", evidence[at + len(answer):])
            answer = answer + tail.group(0) if tail else answer
        if re.fullmatch(r"\\d{4}", answer) and re.search(r"\\b(date|day)\\b", question.lower()):
            month = r"(?:January|February|March|April|May|June|July|August|September|October|November|December)"
            date = re.search(month + r" \\d{1,2}, " + answer + r"|\\d{1,2} " + month + " " + answer, evidence)
            answer = date.group(0) if date else answer
        return answer, evidence

    def doubtful(answer, evidence):
        words = set(norm(answer).split())
        return bool(evidence) and (norm(answer) not in norm(evidence) or words <= set(norm(question).split()))

    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for ex in EXAMPLES:
        messages += [{"role": "user", "content": USER_TEMPLATE.format(question=ex["question"], passages=ex["passages"])},
                     {"role": "assistant", "content": f"<answer>{ex['answer']}</answer>"}]
    passages = look_up(make_query(question))
    messages.append({"role": "user", "content": USER_TEMPLATE.format(question=question, passages=passages)})
    for _ in range(MAX_TURNS):
        reply = llm(messages, max_tokens=MAX_TOKENS)
        answer = extract_answer(reply, question)
        if answer is not None:
            answer, evidence = repair(answer)
            if not doubtful(answer, evidence):
                return answer
            why = "is not in the search result" if norm(answer) not in norm(evidence) else "only repeats the question"
            messages += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": f"\\"{answer}\\" {why}. Copy the words of the search result "
                                                     f"that answer: {question} Reply as <answer>words</answer>."}]
            second = extract_answer(llm(messages, max_tokens=MAX_TOKENS), question)
            second = repair(second)[0] if second is not None else None
            return second if second is not None and not doubtful(second, evidence) else answer
        m = re.search(r"<search>(.*?)</search>", reply, re.DOTALL)
        result = f"Search result:\\n{look_up(m.group(1).strip())}\\n\\n" if m else ""
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": result + NUDGE}]
    return None
''',
        # the repair alone, without the correction turn: one model call fewer per doubtful answer
        '''def run(task, llm, tools):
    """h0's loop; the answer is completed from the evidence shown: a name cut at an initial
    gets the rest of the name, and a year the text's whole date when the question asks for one."""
    import re
    question = task["question"]
    shown = []

    def look_up(query):
        text = format_passages(question, tools.search(query, **RETRIEVAL))
        shown.append(text)
        return text

    def repair(answer):
        evidence = " ".join(line.partition(": ")[2] for text in shown for line in text.splitlines())
        at = evidence.lower().find(answer.lower())
        if at >= 0 and re.search(r"(^|\\s)[A-Z]$", answer):  # "John D" -> "John D. Rockefeller"
            tail = re.match(r"\\.?(?:\\s+[A-Z][\\w'-]*)+", evidence[at + len(answer):])
            answer = answer + tail.group(0) if tail else answer
        if re.fullmatch(r"\\d{4}", answer) and re.search(r"\\b(date|day)\\b", question.lower()):
            month = r"(?:January|February|March|April|May|June|July|August|September|October|November|December)"
            date = re.search(month + r" \\d{1,2}, " + answer + r"|\\d{1,2} " + month + " " + answer, evidence)
            answer = date.group(0) if date else answer
        return answer

    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for ex in EXAMPLES:
        messages += [{"role": "user", "content": USER_TEMPLATE.format(question=ex["question"], passages=ex["passages"])},
                     {"role": "assistant", "content": f"<answer>{ex['answer']}</answer>"}]
    passages = look_up(make_query(question))
    messages.append({"role": "user", "content": USER_TEMPLATE.format(question=question, passages=passages)})
    for _ in range(MAX_TURNS):
        reply = llm(messages, max_tokens=MAX_TOKENS)
        answer = extract_answer(reply, question)
        if answer is not None:
            return repair(answer)
        m = re.search(r"<search>(.*?)</search>", reply, re.DOTALL)
        result = f"Search result:\\n{look_up(m.group(1).strip())}\\n\\n" if m else ""
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": result + NUDGE}]
    return None
''',
        # Self-consistency, checked against the evidence. At T 0.3 the 8 replies to one question
        # often disagree, and the answer most of them give is right more often than one reply is
        # (harness split, the first 32 questions x 8 under cand_005 of results/runs/cpu-long-look
        # seed 0: a reply 0.086, the plurality answer 0.125): the replies are sampled together
        # (llm(..., n=5): one prefill, one shared prompt cache), each a call of the trace. The
        # vote's own failures (cpu-long-vote seed 0's cand_026, harness split) are of two kinds a
        # check against the evidence mends when the question asks for a number or a time: a
        # reply of the wrong kind ("1.4" for "how many professional schools", the text saying
        # "seven professional schools") and a right one cut wrong ("20,000 warriors" for
        # "20,000"; "2007" where the text has "8 February 2007"). Registered before measuring
        # (checked vote >= plain vote, else no change), on all 128 harness questions x 4 under
        # that cand_026: the plain vote 0.113, the checked vote 0.166, +5.3 ± 2.0 (paired SE).
        '''def run(task, llm, tools):
    """The second alternative's loop and repair, 5 replies to its first turn, the answer most give
    wins; checked against the evidence shown when the question asks for a number ("how many/much")
    or a time ("when", "what year"): a reply counts only with a span of that kind that is in the
    evidence and not in the question (the span alone: "20,000 warriors" -> "20,000"; a year widened
    to the evidence's whole date), and when no reply has one, the evidence's span of that kind
    nearest the question's words answers. Other questions: the plain vote (a tie goes to the
    earliest reply; no answer in any reply: the next turn follows the first one)."""
    import collections
    import re
    question = task["question"]
    votes = 5  # replies to the first turn: one llm call, sampled together
    shown = []
    months = "January|February|March|April|May|June|July|August|September|October|November|December"
    words = "one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|twenty|thirty|forty|fifty|hundred"
    spans = {  # what an answer of each kind looks like
        "number": rf"\\b(?:\\d[\\d,]*(?:\\.\\d+)?%?|(?:{words})(?:-(?:one|two|three|four|five|six|seven|eight|nine))?)"
                  r"(?:\\s+(?:million|billion|thousand|hundred|percent|per cent))?\\b",
        "time": rf"\\b(?:\\d{{1,2}} (?:{months}) \\d{{4}}|(?:{months}) \\d{{1,2}}, \\d{{4}}|(?:{months}) \\d{{4}}"
                rf"|(?:early |mid-|late )?\\d{{4}}s?|\\d{{1,2}}(?:st|nd|rd|th) century)\\b",
    }
    q = question.lower()
    kind = ("number" if re.search(r"\\bhow (?:many|much)\\b", q) else
            "time" if re.search(r"\\b(?:when|what year|which year|what date|what day)\\b", q) else None)

    def look_up(query):
        text = format_passages(question, tools.search(query, **RETRIEVAL))
        shown.append(text)
        return text

    def evidence():
        return " ".join(line.partition(": ")[2] for text in shown for line in text.splitlines())

    def repair(answer):
        text = evidence()
        at = text.lower().find(answer.lower())
        if at >= 0 and re.search(r"(^|\\s)[A-Z]$", answer):  # "John D" -> "John D. Rockefeller"
            tail = re.match(r"\\.?(?:\\s+[A-Z][\\w'-]*)+", text[at + len(answer):])
            answer = answer + tail.group(0) if tail else answer
        return answer

    def key(answer):
        return " ".join(re.findall(r"\\w+", answer.lower()))

    def given(span):  # a number or year the question gives is not its answer
        return f" {key(span)} " in f" {key(question)} "

    def of_kind(answer):
        """The span of the asked kind in an answer, if the evidence has it and the question does not;
        a year -> its whole date."""
        text = evidence()
        for m in re.finditer(spans[kind], answer, re.IGNORECASE):
            span = m.group(0)
            if key(span) and f" {key(span)} " in f" {key(text)} " and not given(span):
                wider = [d.group(0) for d in re.finditer(spans[kind], text) if key(span) in key(d.group(0))]
                return max(wider, key=len) if kind == "time" and wider else span
        return None

    def from_evidence():
        """The span of the asked kind in the evidence closest to the question's words (each of them
        within 6 words counts 1 / its distance: "seven millers" for "how many millers"; its
        numbers do not count, they are not the answer)."""
        text = evidence()
        asked = set(re.findall(r"[^\\W\\d]+", q)) - {"how", "many", "much", "when", "what", "which", "year", "the",
                                                  "a", "an", "of", "in", "did", "was", "is", "do", "does"}
        best, score = None, 0
        for m in re.finditer(spans[kind], text, re.IGNORECASE):
            if given(m.group(0)):
                continue
            before = re.findall(r"\\w+", text[:m.start()].lower())[-6:][::-1]  # nearest first
            after = re.findall(r"\\w+", text[m.end():].lower())[:6]
            s = sum(1 / (d + 1) for side in (before, after) for d, w in enumerate(side) if w in asked)
            if best is None or s > score:
                best, score = m.group(0), s
        return best

    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for ex in EXAMPLES:
        messages += [{"role": "user", "content": USER_TEMPLATE.format(question=ex["question"], passages=ex["passages"])},
                     {"role": "assistant", "content": f"<answer>{ex['answer']}</answer>"}]
    passages = look_up(make_query(question))
    messages.append({"role": "user", "content": USER_TEMPLATE.format(question=question, passages=passages)})
    for turn in range(MAX_TURNS):
        replies = llm(messages, max_tokens=MAX_TOKENS, n=votes if turn == 0 else 1)
        answers = [repair(a) for a in (extract_answer(r, question) for r in replies) if a is not None]
        if kind:
            typed = [s for s in map(of_kind, answers) if s]
            answers = typed or [s for s in [from_evidence()] if s] or answers
        if answers:
            counts = collections.Counter(key(a) for a in answers)
            return max(answers, key=lambda a: counts[key(a)])  # max keeps the first of equals
        m = re.search(r"<search>(.*?)</search>", replies[0], re.DOTALL)
        result = f"Search result:\\n{look_up(m.group(1).strip())}\\n\\n" if m else ""
        messages += [{"role": "assistant", "content": replies[0]}, {"role": "user", "content": result + NUDGE}]
    return None
''',
    ],
}
# the axes that are only prompt text: all that --method fst's prompt-only search may change
PROMPT_AXES = {"SYSTEM_PROMPT", "USER_TEMPLATE", "EXAMPLES", "NUDGE"}
