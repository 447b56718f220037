"""Train the small Llama model that ships inside logitloop, on Python's own documentation.

    python scripts/train_tiny.py --workdir runs/tiny --out logitloop/models/tiny
    python scripts/train_tiny.py --workdir runs/draft --out logitloop/models/tiny_draft \
        --tokenizer-from logitloop/models/tiny --hidden 64 --layers 2 --heads 2 \
        --kv-heads 1 --ffn 192          # a smaller draft for speculative decoding

The text is `pydoc_data.topics` (the help() topics, about 465 kB, shipped with every
Python). A byte-level BPE tokenizer is trained on the same text with `tokenizers`. Whole
topics are held out for validation.

The model also learns a chat format from the same text: every section of a topic (its
title, underlined) becomes short conversations, the title asked as a question in a few
phrasings and the section's opening paragraphs as the reply, rendered with `CHAT_TEMPLATE`
(ChatML: `<|im_start|>role\n...<|im_end|>\n`, two special tokens of the tokenizer) by
`logitloop.conversation`, the code that renders a conversation for `ll.chat`.
`--chat-fraction` of every batch's rows are windows that begin at a conversation.

Training checkpoints with Orbax every `--ckpt-every` steps and resumes from the newest
checkpoint when run again with the same `--workdir`; batches are a function of (seed, step)
only, so a resumed run continues exactly where the interrupted one was going, and a fixed
seed reproduces the run.

The result is exported as an ordinary Hugging Face checkpoint folder (config.json,
model.safetensors in bfloat16, tokenizer.json, tokenizer_config.json with the chat template,
generation_config.json whose eos_token_id lists <|endoftext|> and <|im_end|>).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from logitloop.conversation import ChatTemplate
from logitloop.models.config import LlamaConfig, RopeConfig
from logitloop.models.export import save_pretrained
from logitloop.models.llama import LlamaModel

EOS = "<|endoftext|>"
TURN_START, TURN_END = "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
REPLY_CHARS = 400  # a reply is the section's opening paragraphs, up to this many characters
# A section title: a line underlined by a line of * = - ~ ^ of the same length.
_HEADING = re.compile(r"^(\S[^\n]*)\n([*=\-~^]+)\n", re.M)


def corpus(seed: int, val_fraction: float) -> tuple[list[str], list[str]]:
    """Split the help topics into train and validation documents (whole topics)."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    names = sorted(topics)
    order = np.random.default_rng(seed).permutation(len(names))
    total = sum(len(topics[n]) for n in names)
    val, size = [], 0
    for i in order:
        if size >= val_fraction * total:
            break
        val.append(names[i])
        size += len(topics[names[i]])
    train = [topics[n] for n in names if n not in val]
    return train, [topics[n] for n in sorted(val)]


def _opening(text: str) -> str:
    """A section's opening paragraphs, up to REPLY_CHARS characters (a first paragraph that
    is longer is cut after its last sentence that fits, or its last word)."""
    paragraphs = [p.strip("\n") for p in text.strip("\n").split("\n\n") if p.strip()]
    out = ""
    for p in paragraphs:
        if out and len(out) + 2 + len(p) > REPLY_CHARS:
            break
        out = f"{out}\n\n{p}" if out else p
    if len(out) > REPLY_CHARS:
        cut = out[:REPLY_CHARS]
        end = cut.rfind(". ")
        out = cut[: end + 1] if end > 0 else cut.rsplit(" ", 1)[0]
    return out


def sections(topic: str) -> list[tuple[str, str]]:
    """(title, reply) for every titled section of a help topic."""
    heads = [m for m in _HEADING.finditer(topic) if len(m.group(2)) == len(m.group(1))]
    out = []
    for m, nxt in zip(heads, [*heads[1:], None], strict=True):
        body = topic[m.end() : None if nxt is None else nxt.start()]
        reply = _opening(body)
        if reply:
            out.append((m.group(1).strip(), reply))
    return out


def questions(title: str) -> list[str]:
    """A section title asked a few ways: as it is, without its quotes, and in two questions."""
    plain = title.replace('"', "")
    low = plain[:1].lower() + plain[1:] if plain[1:2].islower() else plain
    return [title, plain, f"What is {low}?", f"Tell me about {low}."]


def conversations(topics: list[str], template: ChatTemplate, every: bool) -> list[str]:
    """Each section as one rendered conversation per phrasing (`every`) or only its title."""
    out = []
    for topic in topics:
        for title, reply in sections(topic):
            for question in questions(title) if every else [title]:
                turns = [
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": reply},
                ]
                out.append(template.render(turns, add_generation_prompt=False))
    return out


def train_tokenizer(texts: list[str], vocab_size: int, path: Path) -> Tokenizer:
    if path.is_file():
        return Tokenizer.from_file(str(path))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, TURN_START, TURN_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return tok


def encode(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for t in texts:
        ids.extend(tok.encode(t).ids)
        ids.append(eos)
    return np.asarray(ids, np.int32)


def extend_tokenizer(source: Path, path: Path) -> None:
    """`source` with the chat tokens it lacks added as special tokens (at the end of the
    vocabulary), saved to `path` unless a resumed run already did."""
    if path.is_file():
        return
    tok = Tokenizer.from_file(str(source))
    missing = [t for t in (EOS, TURN_START, TURN_END) if tok.token_to_id(t) is None]
    tok.add_special_tokens(missing)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))


def initial_model(folder: Path, tok: Tokenizer, seed: int) -> tuple[LlamaModel, dict | None]:
    """The model exported in `folder`, in float32, with a row of the embedding for each token
    `extend_tokenizer` added (the mean of the others), and its training report."""
    from logitloop.models.loading import load_pretrained

    base = load_pretrained(folder, dtype="float32")
    config = dataclasses.replace(base.config, vocab_size=tok.get_vocab_size())
    model = LlamaModel(config, rngs=nnx.Rngs(seed))
    old = base.embedding[...]  # [V_old, E]
    added = jnp.broadcast_to(old.mean(0), (config.vocab_size - old.shape[0], old.shape[1]))
    nnx.update(model, nnx.state(base, nnx.Param))  # every tensor but the embedding fits
    model.embedding.value = jnp.concatenate([old, added])
    report = folder / "training_report.json"
    return model, json.loads(report.read_text()) if report.is_file() else None


def encode_chats(tok: Tokenizer, chats: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The conversations back to back (a window that runs past one reads on into the next,
    like a conversation of several turns), and where each one starts."""
    pieces = [np.asarray(tok.encode(c).ids, np.int32) for c in chats]
    starts = np.cumsum([0] + [len(p) for p in pieces[:-1]])
    return np.concatenate(pieces), starts.astype(np.int64)


def forward_all(model: LlamaModel, tokens: jax.Array) -> jax.Array:
    """Logits at every position, [B, T, V] (training needs them all; decoding needs one):
    the model's own blocks, final norm and head."""
    batch, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length)[None, :], (batch, length))
    x, _ = model.hidden_states(tokens, positions, model.init_cache(batch, length))
    logits = jnp.einsum(
        "bte,ve->btv",
        model.output_norm(x),
        model.head_weight(),
        preferred_element_type=jnp.float32,
    )
    return model.output_logits(logits)


def loss_fn(model: LlamaModel, batch: jax.Array) -> jax.Array:
    logits = forward_all(model, batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def batch_at(
    data: np.ndarray,
    chats: tuple[np.ndarray, np.ndarray],
    seed: int,
    step: int,
    batch: int,
    seq: int,
    chat_rows: int,
) -> np.ndarray:
    """The training batch of `step`: `batch - chat_rows` windows of the text and `chat_rows`
    windows that begin at a conversation. Depends on (seed, step) only, so resuming is
    exact."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(data) - seq - 1, size=batch - chat_rows)
    rows = [data[s : s + seq + 1] for s in starts]
    chat, chat_starts = chats
    fits = chat_starts[chat_starts <= len(chat) - seq - 1]
    rows += [chat[s : s + seq + 1] for s in rng.choice(fits, size=chat_rows)]
    return np.stack(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="runs/tiny")
    ap.add_argument("--out", default="logitloop/models/tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=704)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--val-fraction", type=float, default=0.05)
    ap.add_argument(
        "--chat-fraction", type=float, default=1 / 3, help="rows of a batch that are chats"
    )
    ap.add_argument("--max-minutes", type=float, default=None, help="stop early (resumable)")
    ap.add_argument(
        "--init-from",
        metavar="FOLDER",
        help="start from this script's export (its weights and tokenizer; the chat tokens "
        "it lacks are added); the model-size flags are then the folder's",
    )
    ap.add_argument(
        "--tokenizer-from",
        metavar="FOLDER",
        help="use this export's tokenizer (with the chat tokens it lacks added) instead of "
        "training one, with the model-size flags as given: a draft model for that export "
        "(speculative decoding needs the target's tokenizer)",
    )
    args = ap.parse_args()
    if args.init_from is not None and args.tokenizer_from is not None:
        ap.error("--init-from brings its tokenizer: drop --tokenizer-from")

    workdir = Path(args.workdir).absolute()
    train_texts, val_texts = corpus(args.seed, args.val_fraction)
    source = args.init_from or args.tokenizer_from
    if source is not None:
        extend_tokenizer(Path(source) / "tokenizer.json", workdir / "tokenizer.json")
    tok = train_tokenizer(train_texts + val_texts, args.vocab, workdir / "tokenizer.json")
    train, val = encode(tok, train_texts), encode(tok, val_texts)
    print(f"train {len(train)} tokens, validation {len(val)} tokens, vocab {tok.get_vocab_size()}")
    template = ChatTemplate(CHAT_TEMPLATE, {"eos_token": EOS, "pad_token": EOS})
    chats = encode_chats(tok, conversations(train_texts, template, every=True))
    val_chats, val_chat_starts = encode_chats(tok, conversations(val_texts, template, False))
    chat_rows = round(args.batch * args.chat_fraction)
    print(
        f"chat: {len(chats[1])} conversations ({len(chats[0])} tokens), "
        f"{chat_rows} of {args.batch} rows per batch; validation {len(val_chat_starts)}"
    )

    eos = tok.token_to_id(EOS)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=args.context,
        rms_norm_eps=1e-5,
        rope=RopeConfig(theta=10000.0),
        tie_word_embeddings=True,
        eos_token_id=(eos,),
        bos_token_id=None,
    )
    init_report = None
    if args.init_from is not None:
        model, init_report = initial_model(Path(args.init_from), tok, args.seed)
        config = model.config
    else:
        model = LlamaModel(config, rngs=nnx.Rngs(args.seed))
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"model: {n_params / 1e6:.2f}M parameters")

    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, min(100, args.steps // 10), args.steps, end_value=args.lr / 20
    )
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.1))
    graphdef, params = nnx.split(model, nnx.Param)
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, batch):
        def f(p):
            return loss_fn(nnx.merge(graphdef, p), batch)

        loss, grads = jax.value_and_grad(f)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def eval_loss(params, batch):
        return loss_fn(nnx.merge(graphdef, params), batch)

    val_batches = [val[i : i + args.seq + 1] for i in range(0, len(val) - args.seq - 1, args.seq)]
    val_batches = np.stack(val_batches)
    # every held-out conversation that fits a window, from its start
    val_chat_batches = np.stack(
        [val_chats[s : s + args.seq + 1] for s in val_chat_starts if s + args.seq < len(val_chats)]
    )

    def validate(params, batches=val_batches) -> float:
        losses = [
            float(eval_loss(params, jnp.asarray(batches[i : i + args.batch])))
            for i in range(0, len(batches), args.batch)
        ]
        return float(np.mean(losses))

    manager = ocp.CheckpointManager(
        workdir / "checkpoints",
        options=ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=args.ckpt_every),
    )
    start = 0
    if manager.latest_step() is not None:
        start = manager.latest_step()
        target = {"params": params, "opt_state": opt_state}
        restored = manager.restore(start, args=ocp.args.StandardRestore(target))
        params, opt_state = restored["params"], restored["opt_state"]
        print(f"resumed from step {start}")

    log = []
    t0 = time.time()
    loss = float("nan")
    for step in range(start, args.steps):
        rows = batch_at(train, chats, args.seed, step, args.batch, args.seq, chat_rows)
        batch = jnp.asarray(rows)
        params, opt_state, loss = train_step(params, opt_state, batch)
        done = step + 1
        manager.save(done, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
        if done % 25 == 0:
            print(f"step {done} loss {float(loss):.3f} ({time.time() - t0:.0f}s)", flush=True)
        if done % args.eval_every == 0 or done == args.steps:
            v, vc = validate(params), validate(params, val_chat_batches)
            log.append(
                {"step": done, "train_loss": float(loss), "val_loss": v, "chat_val_loss": vc}
            )
            print(
                f"step {done} validation loss {v:.3f} (ppl {math.exp(v):.1f}), chat {vc:.3f}",
                flush=True,
            )
        if args.max_minutes is not None and time.time() - t0 > 60 * args.max_minutes:
            if manager.latest_step() != done:
                state = {"params": params, "opt_state": opt_state}
                manager.save(done, args=ocp.args.StandardSave(state), force=True)
            manager.wait_until_finished()
            print(f"stopping after {done} steps (--max-minutes); run again to resume")
            return
    manager.wait_until_finished()

    val_loss, chat_val_loss = validate(params), validate(params, val_chat_batches)
    nnx.update(model, params)
    end_of_turn = tok.token_to_id(TURN_END)
    out = save_pretrained(
        model,
        args.out,
        dtype=jnp.bfloat16,
        tokenizer_json=workdir / "tokenizer.json",
        tokenizer_config={
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": EOS,
            "pad_token": EOS,
            "model_max_length": config.max_position_embeddings,
            "chat_template": CHAT_TEMPLATE,
        },
        generation_config={
            "eos_token_id": [eos, end_of_turn],
            "max_length": config.max_position_embeddings,
        },
    )
    report = {
        "steps": args.steps,
        "seed": args.seed,
        "parameters": int(n_params),
        "train_tokens": int(len(train)),
        "validation_tokens": int(len(val)),
        "validation_loss": val_loss,
        "chat_validation_loss": chat_val_loss,
        "chat_conversations": int(len(chats[1])),
        "chat_tokens": int(len(chats[0])),
        "initialised_from": None
        if init_report is None
        else {"folder": str(args.init_from), "training_report": init_report},
        "log": log,
        "args": vars(args),
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"validation loss {val_loss:.3f}, chat {chat_val_loss:.3f}; exported to {out}")


if __name__ == "__main__":
    main()
