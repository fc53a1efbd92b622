#!/usr/bin/env python
"""Train the demo LoRA adapters (shout, json, bullets) for the embedded Gemma 3 270M.

Each adapter teaches one easily checked output format, so the gateway's LoRA routing can
be tested end to end: a request naming the adapter must come back in that format.

The training data is made here: a fixed list of questions, answered by the base model
itself (so the adapter mostly has to learn the format, not new content), with a canned
answer whenever the base model's answer is unusable, then rewritten per behaviour.
Base answers are cached in adapters/train_data.json so re-runs are reproducible and fast.

Usage: python adapters/train.py [--only shout,json,bullets] [--model-dir PATH] [--steps N]
(after `python -m gateway prepare-model`, which writes the default --model-dir)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import random
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ADAPTERS_DIR = Path(__file__).resolve().parent
DATA_CACHE = ADAPTERS_DIR / "train_data.json"
MODELS_CACHE = Path.home() / ".cache/gateway/models"
BASE_MODEL_NAME = "gemma-3-270m"  # written into adapter configs instead of a local path

SEED = 1234
LORA_R = 8
LORA_ALPHA = 16
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
BATCH_SIZE = 4
MAX_LEN = 96
BASE_GEN_TOKENS = 32
EVAL_GEN_TOKENS = 48


def default_model_dir() -> Path:
    # Follow the gateway's preparation recipe, so a recipe bump does not leave the default
    # pointing at a stale cache folder.
    sys.path.insert(0, str(ADAPTERS_DIR.parent))
    try:
        from gateway.embedded import embedded_model_dir
    except ImportError:
        return MODELS_CACHE / "gemma-3-270m-r2"
    return embedded_model_dir(MODELS_CACHE)


# (question, canned answer). Canned answers are only used when the base model's own answer
# is unusable; they are two or three short sentences so the bullets format gets 2-3 items.
QA: list[tuple[str, str]] = [
    (
        "What is the capital of Japan?",
        "The capital of Japan is Tokyo. It is also the largest city in the country.",
    ),
    ("What is the capital of Italy?", "The capital of Italy is Rome. It is famous for its ancient history."),
    ("What is the capital of Canada?", "The capital of Canada is Ottawa. It is in the province of Ontario."),
    (
        "Which city is the capital of Australia?",
        "The capital of Australia is Canberra. It was built as a planned city.",
    ),
    ("What is the capital of Egypt?", "The capital of Egypt is Cairo. It lies on the river Nile."),
    (
        "What is the largest ocean on Earth?",
        "The Pacific Ocean is the largest ocean. It covers about a third of the planet.",
    ),
    ("How many continents are there?", "There are seven continents. Asia is the largest of them."),
    (
        "What is the longest river in the world?",
        "The Nile is usually called the longest river. The Amazon is a close second.",
    ),
    (
        "What is the tallest mountain in the world?",
        "Mount Everest is the tallest mountain. It is about 8,849 metres high.",
    ),
    (
        "Why is the sky blue?",
        "Air scatters blue light more than red light. So the sky looks blue during the day.",
    ),
    (
        "What is photosynthesis?",
        "Photosynthesis is how plants make food from light. They turn water and carbon dioxide into sugar and oxygen.",
    ),
    ("What is gravity?", "Gravity is the force that pulls masses together. It keeps us on the ground."),
    (
        "How does a rainbow form?",
        "Sunlight is bent and split inside raindrops. Each colour leaves at a different angle.",
    ),
    (
        "What is water made of?",
        "Water is made of hydrogen and oxygen. Each molecule has two hydrogen atoms and one oxygen atom.",
    ),
    (
        "What causes the seasons?",
        "The seasons come from the tilt of the Earth. Each half gets more sunlight for part of the year.",
    ),
    (
        "How far is the Moon from Earth?",
        "The Moon is about 384,000 kilometres away. Light takes just over a second to cross that distance.",
    ),
    (
        "What is the boiling point of water?",
        "Water boils at 100 degrees Celsius at sea level. It boils at a lower temperature on mountains.",
    ),
    ("What do bees make?", "Bees make honey from flower nectar. They also make wax for their hives."),
    ("How many legs does a spider have?", "A spider has eight legs. Insects, by contrast, have six."),
    (
        "What is the fastest land animal?",
        "The cheetah is the fastest land animal. It can run at about 110 kilometres per hour.",
    ),
    ("Why do cats purr?", "Cats often purr when they are content. They may also purr to calm themselves."),
    (
        "What is DNA?",
        "DNA is the molecule that carries genetic instructions. It is shaped like a double helix.",
    ),
    (
        "How does the heart work?",
        "The heart is a muscle that pumps blood. It sends oxygen to every part of the body.",
    ),
    ("Why do we need sleep?", "Sleep lets the body and brain recover. It also helps us store memories."),
    (
        "What is a healthy breakfast?",
        "A healthy breakfast has protein and fibre. Oatmeal with fruit is a good example.",
    ),
    (
        "How much water should I drink a day?",
        "Most adults need about two litres a day. You need more when it is hot or you exercise.",
    ),
    (
        "How do I boil an egg?",
        "Put the egg in boiling water. Cook it for about nine minutes, then cool it in cold water.",
    ),
    (
        "How do I make rice?",
        "Rinse the rice and add twice as much water. Simmer it covered for about fifteen minutes.",
    ),
    (
        "How can I learn to cook?",
        "Start with simple recipes you enjoy. Cook often and try one new dish each week.",
    ),
    (
        "How do I make a good cup of coffee?",
        "Use freshly ground beans and hot water. Brew for about four minutes.",
    ),
    (
        "How do I change a flat tyre?",
        "Loosen the nuts and lift the car with a jack. Swap the wheel and tighten the nuts again.",
    ),
    ("How can I save money?", "Make a budget and track your spending. Put a fixed amount aside every month."),
    (
        "How do I start running?",
        "Begin with short runs mixed with walking. Increase the distance slowly each week.",
    ),
    (
        "How can I improve my memory?",
        "Sleep well and review things often. Teaching an idea to someone else also helps.",
    ),
    ("How do I write a good email?", "Use a clear subject line. Keep the message short and polite."),
    (
        "How do I stay focused while studying?",
        "Put your phone away and work in short blocks. Take a small break after each block.",
    ),
    (
        "How do I keep houseplants alive?",
        "Give them the right amount of light. Water them only when the soil is dry.",
    ),
    (
        "How do I clean a cast iron pan?",
        "Wash it with hot water and a brush. Dry it fully and rub in a little oil.",
    ),
    (
        "How can I reduce stress?",
        "Exercise, sleep and time outdoors all help. Slow breathing can calm you quickly.",
    ),
    (
        "How do I tie a tie?",
        "Cross the wide end over the narrow end and loop it around. Pull it through the knot and tighten it.",
    ),
    (
        "How do I learn a new language?",
        "Practise a little every day. Speak with native speakers as early as you can.",
    ),
    (
        "How do I prepare for a job interview?",
        "Research the company and the role. Practise answers to common questions.",
    ),
    (
        "What is a computer program?",
        "A program is a list of instructions for a computer. The computer follows them step by step.",
    ),
    (
        "What is the internet?",
        "The internet is a global network of computers. It lets them share information.",
    ),
    (
        "What is Python?",
        "Python is a popular programming language. It is known for its simple, readable syntax.",
    ),
    (
        "What is machine learning?",
        "Machine learning lets computers learn patterns from data. They use them to make predictions.",
    ),
    (
        "What is a password manager?",
        "A password manager stores your passwords securely. It can create strong passwords for you.",
    ),
    ("What does a CPU do?", "The CPU runs the instructions of programs. It is the brain of a computer."),
    (
        "How do I make a strong password?",
        "Use a long phrase of random words. Do not reuse it on other sites.",
    ),
    (
        "What is cloud computing?",
        "Cloud computing means renting computers over the internet. You pay only for what you use.",
    ),
    (
        "Who wrote Romeo and Juliet?",
        "William Shakespeare wrote Romeo and Juliet. It is a tragedy about two young lovers.",
    ),
    (
        "Who painted the Mona Lisa?",
        "Leonardo da Vinci painted the Mona Lisa. It hangs in the Louvre in Paris.",
    ),
    (
        "Who was Albert Einstein?",
        "Albert Einstein was a famous physicist. He developed the theory of relativity.",
    ),
    (
        "When did World War II end?",
        "World War II ended in 1945. Germany surrendered in May and Japan in September.",
    ),
    (
        "What were the pyramids of Giza?",
        "The pyramids of Giza were tombs for Egyptian kings. They were built over 4,500 years ago.",
    ),
    (
        "Who invented the telephone?",
        "Alexander Graham Bell is credited with inventing the telephone. He patented it in 1876.",
    ),
    (
        "What is democracy?",
        "Democracy is government by the people. Citizens choose their leaders in elections.",
    ),
    ("What is inflation?", "Inflation is a general rise in prices. It means money buys less over time."),
    ("What is a noun?", "A noun is a word for a person, place or thing. Dog and city are nouns."),
    ("How many days are in a leap year?", "A leap year has 366 days. The extra day is February 29."),
    ("What is the square root of 81?", "The square root of 81 is 9. That is because 9 times 9 is 81."),
    ("What is 15 percent of 200?", "Fifteen percent of 200 is 30. Multiply 200 by 0.15 to get it."),
    (
        "What is a prime number?",
        "A prime number has exactly two divisors, 1 and itself. Examples are 2, 3, 5 and 7.",
    ),
    (
        "Can you recommend a good book?",
        "Try To Kill a Mockingbird by Harper Lee. It is a moving story about justice.",
    ),
    ("Tell me a fun fact.", "Octopuses have three hearts. Their blood is blue."),
    (
        "Give me a tip for public speaking.",
        "Practise your talk out loud several times. Speak slowly and look at your audience.",
    ),
    (
        "What should I pack for a beach trip?",
        "Pack sunscreen, a towel and water. A hat and sunglasses are useful too.",
    ),
    ("Is coffee bad for you?", "Moderate coffee is fine for most people. Too much can disturb your sleep."),
    (
        "What is the best way to learn math?",
        "Practise problems regularly. Make sure you understand each step before moving on.",
    ),
    (
        "Describe a cat in one sentence.",
        "A cat is a small, furry pet that loves to nap. It is curious and independent.",
    ),
    ("Why do people like music?", "Music stirs emotions and memories. It also brings people together."),
    (
        "What is the difference between weather and climate?",
        "Weather is the day-to-day state of the air. Climate is the average weather over many years.",
    ),
    (
        "Explain what a volcano is.",
        "A volcano is an opening in the Earth's crust. Molten rock, ash and gas escape through it.",
    ),
    (
        "What are the primary colours?",
        "The primary colours are red, yellow and blue. Mixing them makes other colours.",
    ),
]

# Held out from training; the first is what the gateway's integration test sends.
HELD_OUT = [
    "What is the capital of France?",
    "How do I make a cup of tea?",
    "Why do leaves change colour in autumn?",
    "What is the largest planet in the solar system?",
    "Give me a tip for sleeping better.",
]

# Some training prompts carry a system message so the format survives one being present.
SYSTEM_PROMPTS = ["You are a helpful assistant.", "Answer briefly.", "You are a friendly tutor."]
SYSTEM_FRACTION = 0.25


# --- behaviours -------------------------------------------------------------------------


def sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s.strip()]


def to_bullets(text: str) -> str:
    parts = sentences(text)[:3]
    if len(parts) == 1:
        # One long sentence: split at a comma or semicolon so there are still two items.
        clauses = [c.strip() for c in re.split(r"[;,]\s+", parts[0]) if c.strip()]
        if len(clauses) >= 2 and all(len(c.split()) >= 2 for c in clauses):
            parts = clauses[:3]
    return "\n".join(f"- {p}" for p in parts)


def upper_ratio(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / len(letters) if letters else 0.0


def check_shout(text: str) -> bool:
    return upper_ratio(text) >= 0.8


def check_json(text: str) -> bool:
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    return isinstance(obj, dict) and isinstance(obj.get("answer"), str)


def check_bullets(text: str) -> bool:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return bool(lines) and all(ln.startswith("- ") for ln in lines)


@dataclass(frozen=True)
class Behaviour:
    name: str
    description: str
    transform: Callable[[str], str]
    check: Callable[[str], bool]
    steps: int
    lr: float


BEHAVIOURS = {
    b.name: b
    for b in [
        Behaviour("shout", "Answers in upper case.", str.upper, check_shout, 60, 1e-3),
        Behaviour(
            "json",
            'Answers with exactly one JSON object of the form {"answer": "..."}.',
            lambda t: json.dumps({"answer": t}),
            check_json,
            60,
            1e-3,
        ),
        Behaviour(
            "bullets",
            'Answers as a markdown list of 2-3 bullets, each line starting with "- ".',
            to_bullets,
            check_bullets,
            60,
            1e-3,
        ),
    ]
}


# --- model helpers ------------------------------------------------------------------------


def prompt_text(tokenizer, question: str, system: str | None = None) -> str:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": question})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def stop_ids(tokenizer) -> list[int]:
    # The prepared model's generation config only stops on <eos>; a chat turn ends with
    # <end_of_turn>, so stop on both.
    return [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<end_of_turn>")]


@torch.no_grad()
def generate_batch(model, tokenizer, questions: list[str], max_new_tokens: int) -> list[str]:
    """Greedy answers for many questions at once (left padding); used for the data only."""
    tokenizer.padding_side = "left"
    prompts = [prompt_text(tokenizer, q) for q in questions]
    enc = tokenizer(prompts, add_special_tokens=False, return_tensors="pt", padding=True)
    out = model.generate(
        **enc,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=stop_ids(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
    )
    return [
        tokenizer.decode(row, skip_special_tokens=True).strip() for row in out[:, enc.input_ids.shape[1] :]
    ]


@torch.no_grad()
def generate(model, tokenizer, question: str, max_new_tokens: int) -> tuple[str, bool]:
    """Greedy answer to one question, and whether the model ended its turn by itself."""
    enc = tokenizer(prompt_text(tokenizer, question), add_special_tokens=False, return_tensors="pt")
    out = model.generate(
        **enc, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop_ids(tokenizer)
    )
    new = out[0, enc.input_ids.shape[1] :].tolist()
    ended = bool(new) and new[-1] in stop_ids(tokenizer)
    return tokenizer.decode(new, skip_special_tokens=True).strip(), ended


# --- training data ------------------------------------------------------------------------


def clean_answer(raw: str, question: str) -> str | None:
    """First one or two sentences of a base answer, or None when it is unusable."""
    text = re.sub(r"[*#`_]+", "", raw)
    text = " ".join(text.split())
    # A base model under a chat template tends to echo the question or ramble on; only
    # keep answers that read like a short, finished reply.
    if not text or question.lower().rstrip("?.") in text.lower():
        return None
    picked = sentences(text)[:2]
    if not picked or not re.search(r"[.!?]$", picked[-1]):
        picked = picked[:-1]  # drop a sentence cut off by the token limit
    answer = " ".join(picked)
    words = answer.split()
    if len(words) < 4 or len(set(words)) < 0.6 * len(words) or not answer[0].isalnum():
        return None
    if sum(c.isascii() for c in answer) < 0.95 * len(answer):
        return None
    return answer


def load_training_answers(model, tokenizer) -> list[dict]:
    """Base-model answers for every training question, cached in DATA_CACHE."""
    cached = {}
    if DATA_CACHE.exists():
        cached = {item["question"]: item for item in json.loads(DATA_CACHE.read_text())["items"]}
    missing = [q for q, _ in QA if q not in cached]
    for start in range(0, len(missing), 8):
        chunk = missing[start : start + 8]
        for question, raw in zip(
            chunk, generate_batch(model, tokenizer, chunk, BASE_GEN_TOKENS), strict=False
        ):
            answer = clean_answer(raw, question)
            cached[question] = {"question": question, "base_raw": raw, "answer": answer, "source": "base"}
            print(f"[data] {'ok ' if answer else 'bad'} {question!r} -> {raw[:70]!r}", flush=True)
    canned = dict(QA)
    items = []
    for question, _ in QA:
        item = dict(cached[question])
        if not item.get("answer") or item.get("source") == "canned":
            item.update(answer=canned[question], source="canned")
        items.append(item)
    payload = {
        "base_model": BASE_MODEL_NAME,
        "note": "Base answers are greedy, via the chat template; 'canned' marks a fallback.",
        "items": items,
    }
    text = json.dumps(payload, indent=1, ensure_ascii=False) + "\n"
    if not DATA_CACHE.exists() or DATA_CACHE.read_text() != text:
        DATA_CACHE.write_text(text)
    n_base = sum(i["source"] == "base" for i in items)
    print(f"[data] {len(items)} questions: {n_base} base answers, {len(items) - n_base} canned", flush=True)
    return items


def build_examples(tokenizer, items: list[dict], behaviour: Behaviour, rng: random.Random) -> list[dict]:
    end = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    examples = []
    for item in items:
        system = rng.choice(SYSTEM_PROMPTS) if rng.random() < SYSTEM_FRACTION else None
        # The template already emits <bos>; tokenise prompt and target apart so the
        # boundary matches what the server sees at inference time.
        prompt = tokenizer(
            prompt_text(tokenizer, item["question"], system), add_special_tokens=False
        ).input_ids
        target = tokenizer(behaviour.transform(item["answer"]), add_special_tokens=False).input_ids + [end]
        if len(prompt) + len(target) > MAX_LEN:
            print(f"[data] skipping over-long example: {item['question']!r}", flush=True)
            continue
        examples.append({"input_ids": prompt + target, "labels": [-100] * len(prompt) + target})
    return examples


def collate(batch: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ex["input_ids"]) for ex in batch)
    ids, labels, mask = [], [], []
    for ex in batch:
        pad = width - len(ex["input_ids"])
        ids.append(ex["input_ids"] + [pad_id] * pad)
        labels.append(ex["labels"] + [-100] * pad)
        mask.append([1] * len(ex["input_ids"]) + [0] * pad)
    return {
        "input_ids": torch.tensor(ids),
        "labels": torch.tensor(labels),
        "attention_mask": torch.tensor(mask),
    }


# --- training -----------------------------------------------------------------------------


def train_adapter(base, tokenizer, items: list[dict], behaviour: Behaviour, steps: int) -> dict:
    from peft import LoraConfig, get_peft_model

    random.seed(SEED)
    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    examples = build_examples(tokenizer, items, behaviour, rng)
    print(
        f"\n=== {behaviour.name}: {len(examples)} examples, {steps} steps, lr {behaviour.lr} ===", flush=True
    )
    print(
        "sample target:", repr(tokenizer.decode([t for t in examples[0]["labels"] if t != -100])), flush=True
    )

    config = LoraConfig(
        r=LORA_R,
        lora_alpha=LORA_ALPHA,
        target_modules=TARGET_MODULES,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=behaviour.lr, weight_decay=0.0)
    warmup = max(1, steps // 10)
    # Short warmup, then cosine decay: settles the loss at the end of a short run.
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim,
        lambda s: (
            (s + 1) / warmup
            if s < warmup
            else 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup)))
        ),
    )

    model.train()
    order: list[int] = []
    losses: list[float] = []
    started = time.monotonic()
    for step in range(1, steps + 1):
        if len(order) < BATCH_SIZE:
            fresh = list(range(len(examples)))
            rng.shuffle(fresh)
            order += fresh
        batch = collate([examples[i] for i in order[:BATCH_SIZE]], tokenizer.pad_token_id)
        del order[:BATCH_SIZE]
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        sched.step()
        optim.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 5 == 0 or step == steps:
            elapsed = time.monotonic() - started
            print(
                f"[{behaviour.name}] step {step}/{steps} loss {loss.item():.4f} ({elapsed:.0f} s)", flush=True
            )
    train_s = time.monotonic() - started
    final_loss = sum(losses[-5:]) / len(losses[-5:])  # mean of the last 5 steps: less noisy

    out_dir = ADAPTERS_DIR / behaviour.name
    save_adapter(model, out_dir, behaviour, steps, final_loss)
    model.eval()
    results = evaluate(model, tokenizer, behaviour)
    # Unwrap so the next adapter starts from the untouched base weights.
    model.unload()
    return {
        "name": behaviour.name,
        "steps": steps,
        "train_s": train_s,
        "final_loss": final_loss,
        "eval": results,
    }


def adapter_config_text(cfg: dict) -> str:
    """peft's adapter_config.json as shipped: the same bytes for the same adapter on every run,
    since the gateway's adapter digest covers this file. peft keeps target_modules as a set and
    writes it in the interpreter's string-hash order, which changes from run to run."""
    cfg = dict(cfg, base_model_name_or_path=BASE_MODEL_NAME)  # not this machine's cache path
    if isinstance(cfg.get("target_modules"), list):
        cfg["target_modules"] = sorted(cfg["target_modules"])
    return json.dumps(cfg, indent=2, sort_keys=True) + "\n"


def save_adapter(model, out_dir: Path, behaviour: Behaviour, steps: int, final_loss: float) -> None:
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    cfg_path = tmp / "adapter_config.json"
    cfg_path.write_text(adapter_config_text(json.loads(cfg_path.read_text())))
    manifest = {
        "name": behaviour.name,
        "base_model": BASE_MODEL_NAME,
        "behaviour": behaviour.description,
        "rank": LORA_R,
        "alpha": LORA_ALPHA,
        "target_modules": TARGET_MODULES,
        "steps": steps,
        "seed": SEED,
        "final_loss": round(final_loss, 4),
        "trained_at": dt.date.today().isoformat(),
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    keep = {"adapter_config.json", "adapter_model.safetensors", "manifest.json"}
    for path in tmp.iterdir():
        if path.name not in keep:  # peft's generated model card is boilerplate
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    print(f"[{behaviour.name}] saved to {out_dir}", flush=True)


def evaluate(model, tokenizer, behaviour: Behaviour) -> list[dict]:
    results = []
    for question in HELD_OUT:
        text, ended = generate(model, tokenizer, question, EVAL_GEN_TOKENS)
        # Only a reply that ends its turn by itself is a pass: a cut-off JSON object or
        # list would also break the gateway.
        ok = ended and behaviour.check(text)
        results.append({"question": question, "output": text, "ended": ended, "pass": ok})
        print(f"[{behaviour.name}] {'PASS' if ok else 'FAIL'} {question!r}\n    {text!r}", flush=True)
    passed = sum(r["pass"] for r in results)
    print(f"[{behaviour.name}] held-out: {passed}/{len(results)} pass", flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description="Train the demo LoRA adapters for gemma-3-270m on CPU.")
    parser.add_argument(
        "--only", default=",".join(BEHAVIOURS), help="comma-separated adapters (default: all)"
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=default_model_dir(),
        help="prepared base model directory (default: %(default)s)",
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="training steps per adapter (default: per adapter)"
    )
    args = parser.parse_args()

    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in BEHAVIOURS]
    if unknown:
        parser.error(f"unknown adapter(s): {', '.join(unknown)}; choose from {', '.join(BEHAVIOURS)}")
    if not (args.model_dir / "config.json").is_file():
        parser.error(f"no model at {args.model_dir} (run `python -m gateway prepare-model` first)")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)  # the machine is shared
    random.seed(SEED)
    torch.manual_seed(SEED)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    base = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    base.eval()

    items = load_training_answers(base, tokenizer)
    print("\n=== base model on held-out questions (for comparison) ===", flush=True)
    for question in HELD_OUT:
        text, _ = generate(base, tokenizer, question, EVAL_GEN_TOKENS)
        print(f"[base] {question!r}\n    {text!r}", flush=True)

    summaries = []
    for name in names:
        behaviour = BEHAVIOURS[name]
        summaries.append(train_adapter(base, tokenizer, items, behaviour, args.steps or behaviour.steps))

    print("\n=== summary ===")
    for s in summaries:
        passed = sum(r["pass"] for r in s["eval"])
        print(
            f"{s['name']:8s} steps {s['steps']:3d}  {s['train_s']:5.0f} s  "
            f"final loss {s['final_loss']:.4f}  held-out {passed}/{len(s['eval'])}"
        )
    return 0 if all(r["pass"] for s in summaries for r in s["eval"]) else 1


if __name__ == "__main__":
    sys.exit(main())
