"""
chat_format.py: how a list of messages becomes prompt token ids, and what ends a reply.

One function for every engine (engine.HFEngine, vllm_engine.VLLMEngine) and, through them, the
`self` proposer (chat_ids): the tokenizer's chat template, or for a model without one (a base
model) plain text turns "System: ...\\n\\nUser: ...\\n\\nAssistant:", where a new turn marker
ends the reply (PLAIN_STOPS); and the token ids that end a reply (stop_token_ids): eos, and
the end-of-turn token(s) the template writes after an assistant turn (<|im_end|>,
<end_of_turn>, ...). --chat-format picks one (resolve_chat_format).

A model's chat template is code someone else wrote (Jinja, which transformers renders in its
sandboxed environment: no file or attribute access, but no time or memory bound either). So
before a template is used it is rendered once on a probe conversation in a separate process
with a deadline and a memory cap (template_probe); one that loops or balloons there is refused.
A template that behaves on the probe and explodes only on some later conversation is not caught.

Left out: tool-call and multimodal parts of a template (only the text of a conversation
reaches the model) and system-prompt merging for templates that have no system role.
"""
import hashlib
import sys

CHAT_FORMATS = ("auto", "template", "plain")
PLAIN_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}
# A base model that has answered goes on writing the conversation it was shown: most often
# "\n\nUser: <a new question>", sometimes another "Assistant:" or "System:" turn. A turn marker
# at the start of a line ends the reply ("\nUser:" matches "\n\nUser:" too; a "User:" in the
# middle of a sentence does not stop it). The engine cuts the text before the marker.
PLAIN_STOPS = ["\nUser:", "\nAssistant:", "\nSystem:"]
# Names templates of the field use for "end of this turn", looked up in the tokenizer's own
# vocabulary (as special tokens) in addition to what its chat template writes (stop_token_ids)
END_OF_TURN_NAMES = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|end_of_turn|>")


def resolve_chat_format(tokenizer, choice: str = "auto", quiet: bool = False) -> str:
    """"template" or "plain". auto = the tokenizer's chat template if it has one, else plain
    (said in one log line). ValueError for an unknown choice or "template" without a template."""
    if choice not in CHAT_FORMATS:
        raise ValueError(f"unknown chat format {choice!r}; choose {', '.join(CHAT_FORMATS)}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if choice == "template" and not has_template:
        raise ValueError("--chat-format template, but its tokenizer has no chat template (use auto or plain)")
    if choice == "auto":
        choice = "template" if has_template else "plain"
        if choice == "plain" and not quiet:
            print("engine: the tokenizer has no chat template (a base model?), so prompts are plain text turns "
                  "'System: ...\\n\\nUser: ...\\n\\nAssistant:' and a reply ends at the next turn marker "
                  "(--chat-format chooses)", file=sys.stderr)
    if choice == "template" and isinstance(tokenizer.chat_template, str):
        why = template_probe(tokenizer.chat_template)
        if why:
            raise ValueError(f"the model's chat template is refused: {why} (--chat-format plain does without it)")
    return choice


PROBE = r"""
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]) << 20, int(sys.argv[1]) << 20))
from jinja2.sandbox import ImmutableSandboxedEnvironment
import jinja2.ext
def raise_exception(message):
    raise ValueError(message)
env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
env.filters["tojson"] = json.dumps
env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: "", namespace=dict)
messages = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Question: " + "x " * 200},
            {"role": "assistant", "content": "An answer."}, {"role": "user", "content": "And?"}]
try:
    text = env.from_string(sys.stdin.read()).render(messages=messages, add_generation_prompt=True,
                                                     bos_token="<s>", eos_token="</s>")
except MemoryError:
    sys.exit(3)
except Exception:
    sys.exit(0)  # it refuses this conversation or needs a global of its own: not a hang (chat_ids will say)
sys.exit(0 if len(text) < (1 << 20) else 4)
"""
_PROBED = {}  # sha256 of a template -> the probe's verdict, once per process


def template_probe(template: str, seconds: float = 10.0, mem_mb: int = 1024) -> str | None:
    """None when rendering `template` on a probe conversation ends within `seconds` and mem_mb of
    memory with under 1 MB of text (or ends in an ordinary error), else why not (one line)."""
    import subprocess
    key = hashlib.sha256(template.encode("utf-8", "replace")).hexdigest()
    if key not in _PROBED:
        try:
            r = subprocess.run([sys.executable, "-c", PROBE, str(mem_mb)], input=template.encode("utf-8", "replace"),
                               capture_output=True, timeout=seconds, env={"PATH": "/usr/bin:/bin"})
            _PROBED[key] = {0: None, 3: f"rendering it needs over {mem_mb} MB",
                            4: "it renders a probe conversation to over 1 MB of text"}.get(
                r.returncode, f"the probe that renders it exited with code {r.returncode}")
        except subprocess.TimeoutExpired:
            _PROBED[key] = f"rendering a probe conversation took over {seconds:g} s"
    return _PROBED[key]


def chat_ids(tokenizer, messages, chat_format: str) -> list[int]:
    """Prompt token ids for a conversation (a str is one user message), ready for the assistant's
    reply. The one formatting function of HFEngine, VLLMEngine and (through them) the `self` proposer."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if chat_format == "plain":
        turns = [f"{PLAIN_ROLES.get(m['role'], m['role'].capitalize())}: {m['content']}" for m in messages]
        # "Assistant:" without a trailing space: BPE tokenizers put the space in front of the next word
        # (" Paris"), so the model continues as it would in text it has seen
        return list(tokenizer("\n\n".join(turns) + "\n\nAssistant:")["input_ids"])  # BOS where the tokenizer adds one
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)  # a dict in transformers 5, a list before


def chat_stop_strings(chat_format: str) -> list[str]:
    """Stop strings the engine adds to every call's own: the plain format's turn markers."""
    return list(PLAIN_STOPS) if chat_format == "plain" else []


def stop_token_ids(tokenizer, generation_config=None) -> set[int]:
    """Token ids that end a reply: the eos ids of generation_config and of the tokenizer, the
    special token(s) the chat template writes right after an assistant's reply (found by
    rendering one), and the END_OF_TURN_NAMES this tokenizer has as special tokens. Without the
    end-of-turn token a template whose turns end in something else than eos would run every
    call to max_tokens, the model talking past its turn."""
    gen_eos = getattr(generation_config, "eos_token_id", None)
    ids = set(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]) | {tokenizer.eos_token_id}
    special = set(tokenizer.all_special_ids) | {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
                                                 if getattr(t, "special", False)}
    if getattr(tokenizer, "chat_template", None):
        marker = "WHALE-END-OF-REPLY"
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi."},
                                                  {"role": "assistant", "content": marker}], tokenize=False)
        except Exception:  # a template that refuses this conversation: eos and the names below still hold
            text = ""
        if marker in text:
            for i in tokenizer(text.split(marker, 1)[1], add_special_tokens=False)["input_ids"]:
                if i not in special:  # the special tokens right after the reply, up to the first plain text
                    break
                ids.add(i)
    vocab = tokenizer.get_vocab()
    ids |= {vocab[n] for n in END_OF_TURN_NAMES if n in vocab and vocab[n] in special}
    return {int(i) for i in ids if i is not None}
