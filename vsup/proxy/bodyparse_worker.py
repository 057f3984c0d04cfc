"""The child process behind bodyparse.BodyParser: it parses a request body's JSON with json.loads
and sends back the body's routing view, so that the proxy's event loop never spends the second a
pathological body costs json.loads (neither json nor msgspec releases the GIL: a thread would not
keep the loop running).

Standard library only, and started as a script (`python -I -S <this file>`, not through the vsup
package, whose import pulls in aiohttp): it starts in 60-160 ms on this busy 2-core box (through
the package: seconds), and nothing on the path can shadow a module it imports.
`python -m vsup.proxy.bodyparse_worker` runs it too.

Protocol on stdin/stdout, one request at a time:
  request  REQUEST (body length, prefix limit) then the body
  received RECEIVED, once the whole body is in (a death before it is not the body's doing)
  reply    REPLY (kind, length) then a pickle of plain data (dicts, lists, str, int, float, bool,
           None, tuples): OK: (view, trimmed keys, dropped count); an error kind: its fields.
It exits when stdin closes (the proxy closed its pipe or died); SIGINT is the proxy's business.

The routing view (`routing_view`): the top-level object with every value kept whole except the
large ones, cut to a leading part (a prefix, as if the value's JSON text were cut and closed):
  - messages, and input when it is a list of messages: the leading messages until their text, as
    affinity.prefix_text counts it (role and content, separators, a part's text or its type and
    URL), reaches `limit` characters; the content of the last one cut at the limit. So
    affinity.routing_key(view) equals routing_key(body) for every prefix_chars <= limit, unless
    the messages before the limit are so many and so small, or carry so much besides their text
    (tool calls), that the field's PROMPT_CUT runs out first (at prefix_chars 2048, the default:
    ~400 empty messages before 2048 characters of text).
  - prompt: a string cut to `limit` characters; a batch of strings: the first cut so, the others
    to FIELD_CUT units at most (at least one of them: it stays a batch); token ids: the first
    max(1, limit // 4) (affinity reads limit // 4), plus the first non-integer after them if there
    is one (kv_aware then still sees "not all token ids").
  - instructions and input strings: cut to `limit` characters.
  - any other value (tools, documents, metadata, ...): whole up to FIELD_CUT units, else cut there.
  - each prompt field costs at most PROMPT_CUT units, the whole view VIEW_BUDGET (decode time in
    the proxy: ~2.5 ns a unit, ~1.3 ms in all, measured); the routing fields (ROUTING_FIRST) and
    the prompt fields are taken first; keys left when it is spent are dropped, counted.
A unit is a character of a string or key plus STR per string or key, SCALAR per number, bool or
null and CONTAINER per list or object: what each costs pickle to rebuild, at ~2.5 ns a unit.
"""

from __future__ import annotations

import fcntl
import json
import os
import pickle
import signal
import struct
import sys
from typing import Any, BinaryIO

REQUEST = struct.Struct("<QQ")  # body length, prefix limit (characters)
REPLY = struct.Struct("<BQ")  # kind, payload length
PIPE_SIZE = 1024 * 1024  # Linux's /proc/sys/fs/pipe-max-size by default
RECEIVED = b"+"  # sent once the whole body is read, before it is parsed

OK, JSON_ERROR, UNICODE_ERROR, RECURSION_ERROR, VALUE_ERROR, NOT_AN_OBJECT, FAILED = range(7)

# Measured (pickle.loads here): a string 120-160 ns (a key: with its slot) + 2 ns a non-ASCII character, a list or object
# 110 ns, a number 20-30 ns; a unit is ~2.5 ns.
STR, SCALAR, CONTAINER = 64, 12, 48
FIELD_CUT = 64 * 1024
VIEW_BUDGET = 512 * 1024
# Each prompt field's most: ~1.3 ms of the view's decode. 2048 characters of messages as affinity
# counts them (the default affinity_prefix_chars) fit unless they average under ~4 characters
# (a role of "tool" and no content: 6), i.e. unless the body was built to miss its own key.
PROMPT_CUT = VIEW_BUDGET // 4
CHARS_PER_TOKEN = 4  # affinity.CHARS_PER_TOKEN: a token id stands for about four characters
# Read before the rest, so that no other key can spend the budget they need: what forward.py, the
# balancers, the gate and rate limits read (the prompt fields come right after).
ROUTING_FIRST = ("model", "stream", "user", "n", "max_tokens", "max_completion_tokens", "max_output_tokens",
                 "cache_salt", "stream_options", "priority", "add_generation_prompt", "continue_final_message",
                 "add_special_tokens")
PROMPTS = ("messages", "prompt", "input", "instructions")


def _cut(value: Any, budget: int, strmax: int | None = None) -> tuple[Any, int, bool]:
    """(the leading part of `value` costing about `budget` units at most, its cost, whether it is
    all of `value`); strings longer than `strmax` are cut to it as well. An item cut short is kept
    and ends its container, so the part is a prefix of the value."""
    if isinstance(value, str):
        keep = len(value) if strmax is None else min(len(value), strmax)
        keep = max(0, min(keep, budget - STR))
        return (value if keep == len(value) else value[:keep]), STR + keep, keep == len(value)
    if isinstance(value, list):
        items: list[Any] = []
        cost = CONTAINER
        for item in value:
            if cost >= budget:
                return items, cost, False
            part, spent, whole = _cut(item, budget - cost, strmax)
            items.append(part)
            cost += spent
            if not whole:
                return items, cost, False
        return items, cost, True
    if isinstance(value, dict):
        members: dict[str, Any] = {}
        cost = CONTAINER
        for key, item in value.items():
            key_cost = STR + len(key)
            if cost + key_cost >= budget:  # a key is never cut: a shortened name is another key
                return members, cost, False
            part, spent, whole = _cut(item, budget - cost - key_cost, strmax)
            members[key] = part
            cost += key_cost + spent
            if not whole:
                return members, cost, False
        return members, cost, True
    return value, SCALAR, True  # numbers, bool, null


def _part_text(part: dict) -> str:
    # affinity._part_text: what affinity reads of a content part
    text = part.get("text")
    if isinstance(text, str):
        return text
    kind = part.get("type")
    kind = kind if isinstance(kind, str) else ""
    payload = part.get(kind) if kind else None
    if isinstance(payload, dict):
        payload = payload.get("url", payload.get("data", payload.get("file_data")))
    return kind + ":" + payload if isinstance(payload, str) else kind


def _cut_content(content: Any, text: int, budget: int) -> tuple[Any, int, bool, int]:
    """A message's content cut to `text` characters as affinity._content_text counts them, and
    `budget` units: (part, cost, whole, the characters affinity reads of the part)."""
    if isinstance(content, str):
        part, cost, whole = _cut(content, budget, text)
        return part, cost, whole, len(part)
    if not isinstance(content, list):
        part, cost, whole = _cut(content, budget)
        return part, cost, whole, 0
    parts: list[Any] = []
    cost = CONTAINER
    size = 0  # affinity's count: each piece and a separator
    for item in content:
        if size >= text or cost >= budget:
            return parts, cost, False, max(0, size - 1)
        # every string of a part cut to the text left: affinity reads no more of any of them
        part, spent, whole = _cut(item, budget - cost, text - size)
        parts.append(part)
        cost += spent
        if isinstance(part, str):
            size += len(part) + 1
        elif isinstance(part, dict):
            size += min(len(_part_text(part)), text - size) + 1
        if not whole:
            return parts, cost, False, max(0, size - 1)
    return parts, cost, True, max(0, size - 1)


def _cut_messages(messages: list, limit: int, budget: int) -> tuple[list, int, bool]:
    """The leading messages until their text, as affinity._messages_text counts it, reaches
    `limit`; `budget` units at most."""
    kept: list[Any] = []
    cost = CONTAINER
    size = 0
    for index, message in enumerate(messages):
        if size >= limit or cost >= budget:
            return kept, cost, False
        if not isinstance(message, dict):
            # affinity stops reading here; the rest is kept as any value is (kv_aware sends it)
            rest, spent, whole = _cut(messages[index:], budget - cost + CONTAINER)
            return kept + rest, cost + spent - CONTAINER, whole
        role = message.get("role")
        role = role if isinstance(role, str) else ""
        text = limit - size
        members: dict[str, Any] = {}
        whole = True
        read = 0
        spent = CONTAINER
        # role and content first, wherever they are: what affinity reads; then the rest
        for key in sorted(message, key=lambda name: name not in ("role", "content")):
            key_cost = STR + len(key)
            left = budget - cost - spent - key_cost
            if left <= 0:
                whole = False
                break
            value = message[key]
            if key == "content":
                part, used, complete, read = _cut_content(value, text, left)
            elif key == "role" and isinstance(value, str):
                # affinity reads the whole role, then keeps `limit` characters of the text
                part, used, complete = _cut(value, left, text)
            else:
                part, used, complete = _cut(value, min(FIELD_CUT, left))
            members[key] = part
            spent += key_cost + used
            whole = whole and complete
        if len(members) > 1:
            members = {key: members[key] for key in message if key in members}  # the message's order
        kept.append(members)
        cost += spent
        size += len(role) + 1 + read + 1
        if not whole:
            return kept, cost, False
    return kept, cost, True


def _cut_prompt(prompt: Any, limit: int, budget: int) -> tuple[Any, int, bool]:
    """A completion prompt as affinity._prompt_text and kv_aware.tokenize_body read it."""
    if not isinstance(prompt, list) or not prompt:
        return _cut(prompt, budget, limit)
    first = prompt[0]
    if isinstance(first, (str, list)):  # a batch: the first prompt, then as many others as fit
        if isinstance(first, str):
            head, cost, whole = _cut(first, budget - CONTAINER, limit)
        else:
            head, cost, whole = _cut_ids(first, limit, budget - CONTAINER)
        cost += CONTAINER
        if len(prompt) == 1:
            return [head], cost, whole
        # at least part of the second prompt, whatever the budget: the view stays a batch
        rest, spent, rest_whole = _cut(prompt[1:], max(min(FIELD_CUT, budget - cost) + CONTAINER, 2 * CONTAINER))
        return [head, *rest], cost + spent - CONTAINER, whole and rest_whole
    return _cut_ids(prompt, limit, budget)


def _cut_ids(ids: list, limit: int, budget: int) -> tuple[list, int, bool]:
    """Token ids: as many as `limit` characters stand for (affinity reads no more), within
    `budget`; when the list goes on, the first value after them that is not a token id too."""
    count = max(1, min(limit // CHARS_PER_TOKEN, (budget - CONTAINER) // SCALAR))
    if len(ids) <= count:
        return _cut(ids, budget)
    head, cost, _ = _cut(ids[:count], budget)
    for value in ids[count:]:
        if type(value) is not int:
            part, spent, _ = _cut(value, max(FIELD_CUT // 16, STR + 1))
            return [*head, part], cost + spent, False
    return head, cost, False


def routing_view(document: dict, limit: int) -> tuple[dict, list[str], int]:
    """(the view of `document`, the keys whose value in it is cut short, how many keys it left
    out): see the module's docstring."""
    left = VIEW_BUDGET
    parts: dict[str, Any] = {}
    trimmed: list[str] = []

    def take(key: str, value: Any) -> None:
        nonlocal left
        room = left - 2 * STR - len(key)
        if room <= 0:
            return
        if key in PROMPTS:
            room = min(room, PROMPT_CUT)
            if key == "instructions":
                part, cost, whole = _cut(value, room, limit)
            elif isinstance(value, list) and (key == "messages" or (value and isinstance(value[0], dict))):
                part, cost, whole = _cut_messages(value, limit, room)
            else:
                part, cost, whole = _cut_prompt(value, limit, room)
        else:
            part, cost, whole = _cut(value, min(FIELD_CUT, room))
        parts[key] = part
        left -= 2 * STR + len(key) + cost  # a top-level key is decoded, then copied into the RoutingView
        if not whole:
            trimmed.append(key)

    for key in ROUTING_FIRST + PROMPTS:
        if key in document:
            take(key, document[key])
    for key, value in document.items():
        if left <= 0:
            break
        if key not in parts:
            take(key, value)
    view = {key: parts[key] for key in document if key in parts}  # the body's order
    return view, trimmed, len(document) - len(view)


def handle(body: bytes | bytearray, limit: int, recursion_limit: int) -> tuple[int, bytes]:
    """One request: (reply kind, its payload)."""
    try:
        document = json.loads(body)
    except json.JSONDecodeError as exc:
        return JSON_ERROR, _dump((exc.msg, exc.pos, exc.lineno, exc.colno))
    except UnicodeDecodeError as exc:
        return UNICODE_ERROR, _dump((exc.encoding, exc.start, exc.end, exc.reason))
    except RecursionError as exc:
        return RECURSION_ERROR, _dump(str(exc))
    except ValueError as exc:  # an integer of more digits than int_max_str_digits allows
        return VALUE_ERROR, _dump(str(exc))
    if not isinstance(document, dict):
        return NOT_AN_OBJECT, _dump(type(document).__name__)
    # The cut recurses once per level of nesting json.loads accepted, on top of this frame, and
    # so does pickle.
    sys.setrecursionlimit(recursion_limit + 100)
    try:
        return OK, _dump(routing_view(document, limit))
    finally:
        sys.setrecursionlimit(recursion_limit)


def _dump(answer: Any) -> bytes:
    return pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)


def _read_exactly(stream: BinaryIO, size: int) -> bytearray | None:
    buffer = bytearray(size)
    view = memoryview(buffer)
    done = 0
    while done < size:
        got = stream.readinto(view[done:])  # type: ignore[attr-defined]
        if not got:
            return None
        done += got
    return buffer


def serve(stdin: BinaryIO, stdout: BinaryIO, recursion_limit: int) -> None:
    while True:
        head = _read_exactly(stdin, REQUEST.size)
        if head is None:
            return
        size, limit = REQUEST.unpack(head)
        body = _read_exactly(stdin, size)
        if body is None:
            return
        stdout.write(RECEIVED)  # from here, a death may be this body's doing; before, it was not
        stdout.flush()
        try:
            kind, payload = handle(body, limit, recursion_limit)
        except MemoryError:
            kind, payload = FAILED, _dump("out of memory")
        except Exception as exc:  # a bug here: reported as such, the proxy answers 503
            kind, payload = FAILED, _dump(f"{type(exc).__name__}: {exc}")
        del body
        stdout.write(REPLY.pack(kind, len(payload)))
        stdout.write(payload)
        stdout.flush()


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the proxy decides
    recursion_limit = int(argv[1]) if len(argv) > 1 else sys.getrecursionlimit()
    sys.setrecursionlimit(recursion_limit)  # json.loads nests as deep as it does in the proxy
    # The pipes on private descriptors, stdin/stdout on /dev/null: a stray print cannot corrupt a reply.
    try:  # a larger pipe: the proxy's loop wakes ~8 times to write 8 MiB, not ~128 (any end sets it)
        fcntl.fcntl(0, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
    except (AttributeError, OSError):
        pass  # not Linux, or over /proc/sys/fs/pipe-max-size
    stdin = os.fdopen(os.dup(0), "rb")
    stdout = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    try:
        serve(stdin, stdout, recursion_limit)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the proxy went away mid-reply
    finally:
        try:
            stdout.close()
        except OSError:
            pass


if __name__ == "__main__":
    main(sys.argv)
