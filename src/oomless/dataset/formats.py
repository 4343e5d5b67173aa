"""Record formats → chat messages: alpaca, sharegpt and OpenAI messages (torch-free).

Each function raises :class:`RecordError` whose message is the reason a bad
record is reported with (file and line are added by oomless.dataset.records).
"""

from __future__ import annotations

from typing import Any

FORMATS = ("alpaca", "sharegpt", "messages")
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant",
                   "assistant": "assistant", "system": "system"}


class RecordError(ValueError):
    """One record is unusable; the message is the reason shown to the user."""


def detect_format(record: dict[str, Any]) -> str:
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record or "output" in record:
        return "alpaca"
    raise RecordError(f"unknown record format (keys: {sorted(record)}); expected "
                      "instruction/output (alpaca), conversations (sharegpt) or messages")


def _text(record: dict[str, Any], key: str, required: bool) -> str:
    value = record.get(key)
    if value is None or value == "":
        if required:
            raise RecordError(f"'{key}' is missing or empty")
        return ""
    if not isinstance(value, str):
        raise RecordError(f"'{key}' must be a string, got {type(value).__name__}")
    return value


def _alpaca_messages(rec: dict[str, Any]) -> list[dict[str, str]]:
    msgs = []
    system = _text(rec, "system", False)
    if system:
        msgs.append({"role": "system", "content": system})
    history = rec.get("history") or []
    if not isinstance(history, list):
        raise RecordError("'history' must be a list of [instruction, response] pairs")
    for i, pair in enumerate(history):
        if (not isinstance(pair, (list, tuple)) or len(pair) != 2
                or not all(isinstance(x, str) and x for x in pair)):
            raise RecordError(f"'history[{i}]' must be a pair of two non-empty strings")
        msgs += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    instruction = _text(rec, "instruction", True)
    extra = _text(rec, "input", False)
    prompt = f"{instruction}\n{extra}" if extra else instruction
    msgs += [{"role": "user", "content": prompt},
             {"role": "assistant", "content": _text(rec, "output", True)}]
    return msgs


def _content(value: Any, where: str) -> str:
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list):  # OpenAI content parts: only text is supported
        kinds = {p.get("type") for p in value if isinstance(p, dict)}
        if kinds - {"text"}:
            raise RecordError(f"{where}: content parts of type {sorted(kinds - {'text'})} "
                              "are not supported for this text model")
        text = "".join(p.get("text", "") for p in value)
        if text:
            return text
    raise RecordError(f"{where}: content must be a non-empty string")


def _turns(items: Any, key: str, role_key: str, text_key: str,
           roles: dict[str, str]) -> list[dict[str, str]]:
    if not isinstance(items, list) or not items:
        raise RecordError(f"'{key}' must be a non-empty list")
    msgs = []
    for i, turn in enumerate(items):
        where = f"'{key}[{i}]'"
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            raise RecordError(f"{where} must be an object with '{role_key}' and '{text_key}'")
        role = roles.get(turn[role_key]) if isinstance(turn[role_key], str) else None
        if role is None:
            raise RecordError(f"{where}: unknown {role_key} {turn[role_key]!r}; "
                              f"expected one of {sorted(roles)}")
        msgs.append({"role": role, "content": _content(turn[text_key], where)})
    return msgs


def _check_order(msgs: list[dict[str, str]]) -> None:
    body = msgs[1:] if msgs and msgs[0]["role"] == "system" else msgs
    for i, msg in enumerate(body):
        expected = "user" if i % 2 == 0 else "assistant"
        if msg["role"] != expected:
            raise RecordError(f"turn {i + 1} is '{msg['role']}', expected '{expected}': "
                              "turns must alternate user/assistant after an optional system")
    if not body or body[-1]["role"] != "assistant":
        raise RecordError("the conversation must end with an assistant turn (nothing to learn)")


def record_to_messages(record: Any, fmt: str = "auto",
                       allow_images: bool = False) -> list[dict[str, str]]:
    """Chat messages of one record in the given (or detected) format."""
    if not isinstance(record, dict):
        raise RecordError(f"a record must be a JSON object, got {type(record).__name__}")
    found = detect_format(record)
    if fmt != "auto" and found != fmt:
        raise RecordError(f"record looks like '{found}' but data.format is '{fmt}'")
    if (record.get("images") or record.get("image")) and not allow_images:
        raise RecordError("record has images; image+text records need a vision-language model")
    if found == "alpaca":
        msgs = _alpaca_messages(record)
    elif found == "sharegpt":
        msgs = _turns(record["conversations"], "conversations", "from", "value", _SHAREGPT_ROLES)
    else:
        roles = {r: r for r in ("system", "user", "assistant")}
        msgs = _turns(record["messages"], "messages", "role", "content", roles)
    _check_order(msgs)
    return msgs


# ChatML, the template family Qwen2 uses; prefix-consistent (the tokens of
# messages[:k] are a prefix of those of messages[:k+1]), which the label
# masking in dataset/records.py relies on.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
