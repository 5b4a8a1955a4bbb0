"""Real text through the workload: scripted multi-turn coding-agent conversations, tokenized.

The random-token workloads of trajectories.py exercise the KV paths, but nobody can read what the
model made of them. Here the same structures (`Workload`, `Trajectory`, `Turn`) carry real text:
twelve scripted conversations of a coding agent in a repository. Every conversation shares one
system prompt (the agent's instructions and tool conventions, so all of them share a KV prefix),
opens with a user task, and then feeds back tool outputs: file listings, failing tests, source
files, grep hits, diffs, linters. They are tokenized with the model's own tokenizer and chat
template (SmolLM2's ChatML by default), so the conductor runs them unchanged.

How the pieces fit the chat template. At run time the context of turn t+1 is

    prompt(t) + the tokens the model generated in turn t + append(t+1)

so the system prompt is the rendered system message, and each append is exactly the text the
template puts between one assistant message's content and the next one's:

    system prompt   <|im_start|>system\\n{SYSTEM}<|im_end|>\\n
    append(0)       <|im_start|>user\\n{task}<|im_end|>\\n<|im_start|>assistant\\n
    append(t >= 1)  <|im_end|>\\n<|im_start|>user\\n{tool output}<|im_end|>\\n<|im_start|>assistant\\n

The appends are derived from the template itself (rendering the conversation with and without
the next message), not hard-coded, and every piece begins or ends at a special token, so
tokenizing the pieces one by one gives the same ids as tokenizing the whole conversation (a test
checks this with the scripted replies in place of the model's). Tool outputs go back as user
messages that begin "Tool output": SmolLM2's template and training know only the system, user
and assistant roles. Generation lengths are small (16 tokens by default): at run time the model
writes the first gen_len tokens of the agent's reply, which is usually cut mid-sentence, and
decode is exactly gen_len tokens (the engines do not stop at <|im_end|>).

Each turn keeps its text (`TextTurn.append_text`, `.message`, `.scripted_reply`) so request records
can carry `prompt_text`/`output_text`; `TextWorkload.decode(tokens)` (or `decode(tokens)`) turns
ids back into text.

Sizes with SmolLM2's tokenizer and gen_len 16 (tests/test_text_workload.py checks the bounds):
12 conversations, 78 turns (6 to 8 each), a 261-token shared system prompt, appends of 69 tokens
on average (23 to 182), prompts of 291 to 955 tokens (587 on average), final contexts of at most
971 tokens; KV hit rate 0.86 with 32-token blocks. On one core SmolLM2 prefills about 8 ms per
token and decodes about 0.2 s per token at these lengths, so one turn costs about 3-4 s and the
whole workload about 4 minutes of CPU per mode, before verification.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .trajectories import Trajectory, Turn, Workload, WorkloadConfig

DEFAULT_GEN_LEN = 16
MAX_CONTEXT = 1536  # every conversation's final context (with planned generations) stays below this


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class TextTurn(Turn):
    append_text: str = ""  # the decoded text of `append` (template tokens included)
    message: str = ""  # the content of the user/tool message this turn adds
    scripted_reply: str = ""  # what a scripted agent answers; the model writes its own at run time


@dataclass(frozen=True)
class TextTrajectory(Trajectory):
    title: str = ""
    task: str = ""


@dataclass(frozen=True)
class TextWorkload(Workload):
    system_text: str = ""  # the decoded text of `system_prompt`
    tokenizer_dir: str = ""  # the checkpoint directory whose tokenizer made the ids

    def decode(self, tokens: Sequence[int]) -> str:
        return decode(tokens, self.tokenizer_dir)

    def prompt_text(self, trajectory: int, t: int, generated: Sequence[Sequence[int]]) -> str:
        """The text of turn t's prompt of one trajectory, given the tokens generated before."""
        return self.decode(self.trajectories[trajectory].prompt(t, generated))


# --------------------------------------------------------------------------- tokenizer


@functools.lru_cache(maxsize=4)
def load_tokenizer(checkpoint: str | Path | None = None) -> Any:
    """The tokenizer (with chat template) of a checkpoint directory; default: SmolLM2's."""
    import os

    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    d = _checkpoint(checkpoint)
    if not (d / "tokenizer.json").is_file():
        raise ValueError(f"{d}: no tokenizer.json; the text workload needs a checkpoint with a tokenizer and "
                         "chat template (e.g. the model 'smollm2')")
    return AutoTokenizer.from_pretrained(str(d), local_files_only=True)


def _checkpoint(checkpoint: str | Path | None) -> Path:
    from dualpath.model.registry import resolve_model

    return resolve_model("smollm2" if checkpoint in (None, "") else checkpoint)


def decode(tokens: Sequence[int], checkpoint: str | Path | None = None) -> str:
    """Token ids -> text with the checkpoint's tokenizer (special tokens kept: <|im_end|> ...)."""
    return load_tokenizer(str(_checkpoint(checkpoint))).decode(list(tokens), skip_special_tokens=False)


def has_chat_template(checkpoint: str | Path) -> bool:
    """Whether a checkpoint directory has a tokenizer and a chat template (so it can run the
    real-text workload), read from its files without loading anything."""
    import json

    d = Path(checkpoint)
    if not (d / "tokenizer.json").is_file():
        return False
    if (d / "chat_template.jinja").is_file():
        return True
    try:
        cfg = json.loads((d / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and bool(cfg.get("chat_template"))


def tokenizer_or_none(checkpoint: str | Path | None) -> Any:
    """The checkpoint directory's tokenizer, or None when it has none (the tiny random models)."""
    if not checkpoint or not (Path(checkpoint) / "tokenizer.json").is_file():
        return None
    return load_tokenizer(str(Path(checkpoint)))


def encode(text: str, checkpoint: str | Path | None = None) -> list[int]:
    """Text -> token ids, without adding BOS/EOS (special tokens written in the text are parsed)."""
    return load_tokenizer(str(_checkpoint(checkpoint))).encode(text, add_special_tokens=False)


# --------------------------------------------------------------------------- building


def _render(tok, messages: list[dict], generation_prompt: bool) -> str:
    return tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)


def conversation_pieces(tok, system: str, task: str, tool_outputs: Sequence[str], replies: Sequence[str]
                        ) -> tuple[str, list[str]]:
    """(system prompt text, append text per turn) of one conversation, derived from the template.

    Turn 0 adds the task, turn t >= 1 the (t-1)-th tool output; `replies[t]` is the scripted
    assistant message of turn t, which stands where the model's generation will be.
    """
    if len(replies) != len(tool_outputs) + 1:
        raise ValueError(f"{len(tool_outputs)} tool outputs need {len(tool_outputs) + 1} replies, got {len(replies)}")
    msgs: list[dict] = [{"role": "system", "content": system}]
    sys_text = _render(tok, msgs, False)
    before = sys_text  # the rendered conversation up to where the next append starts
    appends = []
    for t, content in enumerate([task, *(f"Tool output:\n{o}" for o in tool_outputs)]):
        msgs.append({"role": "user", "content": content})
        now = _render(tok, msgs, True)
        if not now.startswith(before):
            raise ValueError(f"the chat template does not extend the conversation at turn {t}; "
                             "it cannot be cut into appends")
        appends.append(now[len(before):])
        msgs.append({"role": "assistant", "content": replies[t]})
        before = now + replies[t]
    return sys_text, appends


def text_workload(checkpoint: str | Path | None = None, *, gen_len: int | Sequence[int] = DEFAULT_GEN_LEN,
                  n_conversations: int | None = None, max_turns: int | None = None) -> TextWorkload:
    """The scripted coding-agent conversations as a workload.

    checkpoint: whose tokenizer and chat template (a model name or directory; default "smollm2").
    gen_len: tokens generated per turn; a sequence is cycled over each conversation's turns.
    n_conversations: the first n of the scripts (default all of them).
    max_turns: each conversation's first turns only (default all; every script has at least 6).
    """
    if max_turns is not None and max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns!r}")
    ckpt = _checkpoint(checkpoint)
    tok = load_tokenizer(str(ckpt))
    gens = [gen_len] if isinstance(gen_len, int) else list(gen_len)
    if not gens or any(not isinstance(g, int) or g < 1 for g in gens):
        raise ValueError(f"gen_len must be an int >= 1 or a non-empty sequence of them, got {gen_len!r}")
    scripts = CONVERSATIONS if n_conversations is None else CONVERSATIONS[:n_conversations]
    system_text, system_ids = None, None
    trajs = []
    for i, c in enumerate(scripts):
        sys_text, appends = conversation_pieces(tok, SYSTEM_PROMPT, c["task"], c["outputs"], c["replies"])
        if system_text is None:
            system_text = sys_text
            system_ids = tuple(tok.encode(sys_text, add_special_tokens=False))
        elif sys_text != system_text:
            raise ValueError("the chat template renders the shared system prompt differently per conversation")
        messages = [c["task"], *(f"Tool output:\n{o}" for o in c["outputs"])]
        turns = tuple(TextTurn(tuple(tok.encode(a, add_special_tokens=False)), gens[t % len(gens)], append_text=a,
                               message=messages[t], scripted_reply=c["replies"][t])
                      for t, a in enumerate(appends[:max_turns]))
        trajs.append(TextTrajectory(i, system_ids, turns, title=c["title"], task=c["task"]))
    n_turns = [tr.n_turns for tr in trajs]
    apps = [len(u.append) for tr in trajs for u in tr.turns]
    gl = [u.gen_len for tr in trajs for u in tr.turns]
    cfg = WorkloadConfig(
        n_trajectories=len(trajs), turns_mean=float(sum(n_turns) / max(len(trajs), 1)) if trajs else 1.0,
        turns_min=min(n_turns, default=1), append_mean=max(1.0, sum(apps) / max(len(apps), 1)),
        gen_mean=max(1.0, sum(gl) / max(len(gl), 1)), system_prompt_len=len(system_ids or ()),
        max_len=max([tr.final_len() for tr in trajs] + [len(system_ids or ()) + 2]), length_dist="fixed",
        vocab_size=len(tok), name="text-coding-agent",
        notes=(f"scripted coding-agent conversations (dualpath/workload/text.py), tokenizer of {ckpt.name}",))
    return TextWorkload(cfg, system_ids or (), tuple(trajs), system_text=system_text or "", tokenizer_dir=str(ckpt))


# --------------------------------------------------------------------------- the scripts

SYSTEM_PROMPT = """You are DevAgent, an autonomous coding assistant working inside a software repository on a Linux machine. You solve the user's task by running tools and reading their output.

Tools:
- bash: run one shell command in the repository root. Write it in a ```bash block.
- edit: change files. Write a unified diff in a ```diff block; it is applied with `patch -p1`.

Rules:
1. Work in small steps: one tool call per message, then wait for its output.
2. Read the relevant code before you change it. Never guess what a file contains.
3. Run the tests after every change. A task is done only when the tests pass.
4. Keep changes minimal and in the style of the surrounding code.
5. Never delete or skip a test to make it pass, and never commit: the user reviews the diff.
6. If a command fails, read the error message and fix the cause, not the symptom.
7. When you are done, summarise what you changed and why in two or three sentences.

Tool results come back in a user message that starts with "Tool output". Be brief: the user reads every message."""

# Each conversation: a task, the scripted agent's replies (one per turn), and the tool outputs
# that come back after each reply but the last.
CONVERSATIONS: list[dict] = [
    {
        "title": "parser rejects empty input",
        "task": "The test `tests/test_parser.py::test_empty_input` fails since yesterday's refactor. Please fix it.",
        "replies": [
            "Let me run the failing test first.\n```bash\npytest -q tests/test_parser.py::test_empty_input\n```",
            "The parser indexes the first token without checking. Let me read it.\n```bash\nsed -n 1,40p src/calc/parser.py\n```",
            "`parse` must return an empty program for no tokens. Fixing it.\n```diff\n--- a/src/calc/parser.py\n+++ b/src/calc/parser.py\n@@ -12,2 +12,4 @@ def parse(tokens):\n+    if not tokens:\n+        return Program([])\n     head = tokens[0]\n```",
            "Patched. Running the parser tests.\n```bash\npytest -q tests/test_parser.py\n```",
            "All parser tests pass. Running the whole suite to be sure.\n```bash\npytest -q\n```",
            "Everything passes. Showing the diff for review.\n```bash\ngit diff --stat\n```",
            "Done: `parse` now returns an empty `Program` when it gets no tokens instead of indexing `tokens[0]`, which the refactor had exposed. All 48 tests pass.",
        ],
        "outputs": [
            "```\nF                                                                        [100%]\n=================================== FAILURES ===================================\n_______________________________ test_empty_input _______________________________\n\n    def test_empty_input():\n>       assert parse([]) == Program([])\n\ntests/test_parser.py:41:\n_ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _\nsrc/calc/parser.py:13: in parse\n    head = tokens[0]\nE   IndexError: list index out of range\n1 failed in 0.12s\n```",
            "```python\n\"\"\"Recursive-descent parser for calc expressions.\"\"\"\nfrom .ast import Program, BinOp, Num\nfrom .lexer import Token\n\nPRECEDENCE = {\"+\": 1, \"-\": 1, \"*\": 2, \"/\": 2}\n\n\ndef parse(tokens):\n    \"\"\"Parse a list of tokens into a Program.\"\"\"\n    statements = []\n    pos = 0\n    head = tokens[0]\n    while pos < len(tokens):\n        stmt, pos = parse_statement(tokens, pos)\n        statements.append(stmt)\n    return Program(statements)\n```",
            "```\npatching file src/calc/parser.py\n```",
            "```\n.............                                                            [100%]\n13 passed in 0.09s\n```",
            "```\n................................................                         [100%]\n48 passed in 0.61s\n```",
            "```\n src/calc/parser.py | 2 ++\n 1 file changed, 2 insertions(+)\n```",
        ],
    },
    {
        "title": "add a --json flag to the CLI",
        "task": "Add a `--json` option to `todo list` that prints the tasks as a JSON array instead of the table. Keep the table as the default.",
        "replies": [
            "Let me look at the project layout.\n```bash\nls -R src | head -30\n```",
            "The command is in `src/todo/cli.py`. Reading it.\n```bash\ngrep -n \"def list_cmd\" -A 20 src/todo/cli.py\n```",
            "I will add the option and print `json.dumps` of the task dicts.\n```diff\n--- a/src/todo/cli.py\n+++ b/src/todo/cli.py\n@@ -40,3 +40,7 @@\n-def list_cmd(done: bool = False):\n+def list_cmd(done: bool = False, as_json: bool = typer.Option(False, \"--json\")):\n     tasks = store.load(done=done)\n+    if as_json:\n+        print(json.dumps([t.to_dict() for t in tasks], indent=2))\n+        return\n```",
            "Now a test for the new flag, then the suite.\n```bash\npytest -q tests/test_cli.py\n```",
            "`json` is not imported in cli.py. Adding the import.\n```diff\n--- a/src/todo/cli.py\n+++ b/src/todo/cli.py\n@@ -1,3 +1,4 @@\n+import json\n import typer\n```",
            "Running the tests again.\n```bash\npytest -q\n```",
            "Done: `todo list --json` prints the tasks as a JSON array (via `Task.to_dict`), the table stays the default, and a test covers both. All tests pass.",
        ],
        "outputs": [
            "```\nsrc:\ntodo\n\nsrc/todo:\n__init__.py\n__main__.py\ncli.py\nmodels.py\nstore.py\ntable.py\n```",
            "```\n40:def list_cmd(done: bool = False):\n41-    tasks = store.load(done=done)\n42-    if not tasks:\n43-        typer.echo(\"No tasks.\")\n44-        raise typer.Exit(0)\n45-    typer.echo(table.render(tasks))\n```",
            "```\npatching file src/todo/cli.py\n```",
            "```\n..F.                                                                     [100%]\n=================================== FAILURES ===================================\n_______________________________ test_list_json _________________________________\nE       NameError: name 'json' is not defined\nsrc/todo/cli.py:43: NameError\n1 failed, 3 passed in 0.31s\n```",
            "```\npatching file src/todo/cli.py\n```",
            "```\n.....................                                                    [100%]\n21 passed in 0.44s\n```",
        ],
    },
    {
        "title": "flaky date test across time zones",
        "task": "CI fails about once a day in `test_report_dates`. Locally it always passes. Can you find out why?",
        "replies": [
            "Let me read the test.\n```bash\ngrep -n \"def test_report_dates\" -A 15 tests/test_report.py\n```",
            "It compares against `date.today()` while the code uses UTC. Let me check the code.\n```bash\ngrep -rn \"utcnow\\|today()\" src/report/\n```",
            "The report uses UTC, the test local time: they differ near midnight. Let me try it under another time zone.\n```bash\nTZ=Pacific/Kiritimati pytest -q tests/test_report.py::test_report_dates\n```",
            "Reproduced. I will make the test use the same clock as the code.\n```diff\n--- a/tests/test_report.py\n+++ b/tests/test_report.py\n@@ -52 +52 @@\n-    assert report.day == date.today()\n+    assert report.day == datetime.now(timezone.utc).date()\n```",
            "Running it under both time zones.\n```bash\nTZ=Pacific/Kiritimati pytest -q tests/test_report.py && TZ=UTC pytest -q tests/test_report.py\n```",
            "The cause was a mismatch of clocks: `build_report` stamps the day in UTC, but the test compared with the local `date.today()`, so it failed whenever the CI runner's local date differed from UTC. The test now uses the UTC date.",
        ],
        "outputs": [
            "```\n48:def test_report_dates():\n49-    events = [Event(\"deploy\", ts=time.time())]\n50-    report = build_report(events)\n51-    assert report.count == 1\n52-    assert report.day == date.today()\n```",
            "```\nsrc/report/build.py:17:    day = datetime.utcnow().date()\nsrc/report/build.py:31:        stamp = datetime.utcnow().isoformat()\n```",
            "```\nF                                                                        [100%]\nE       AssertionError: assert datetime.date(2026, 3, 4) == datetime.date(2026, 3, 5)\nE        +  where datetime.date(2026, 3, 4) = Report(count=1, day=datetime.date(2026, 3, 4)).day\n1 failed in 0.08s\n```",
            "```\npatching file tests/test_report.py\n```",
            "```\n......                                                                   [100%]\n6 passed in 0.07s\n......                                                                   [100%]\n6 passed in 0.07s\n```",
        ],
    },
    {
        "title": "slow endpoint: N+1 queries",
        "task": "The `/orders` page takes four seconds with 500 orders. Find the bottleneck and make it faster without changing the output.",
        "replies": [
            "Let me profile the view with the query log on.\n```bash\npython manage.py shell -c \"from shop.debug import profile_orders; profile_orders()\"\n```",
            "501 queries: one per order for its customer. Let me read the view.\n```bash\nsed -n 1,30p shop/views/orders.py\n```",
            "Each `order.customer.name` hits the database. I will fetch customers in the same query.\n```diff\n--- a/shop/views/orders.py\n+++ b/shop/views/orders.py\n@@ -9 +9 @@\n-    orders = Order.objects.filter(shop=request.shop).order_by(\"-created\")\n+    orders = Order.objects.filter(shop=request.shop).select_related(\"customer\").order_by(\"-created\")\n```",
            "Profiling again.\n```bash\npython manage.py shell -c \"from shop.debug import profile_orders; profile_orders()\"\n```",
            "Two queries now. Checking the output is unchanged.\n```bash\npytest -q tests/test_orders.py\n```",
            "Fixed an N+1 query: the view loaded each order's customer separately (501 queries for 500 orders). `select_related(\"customer\")` joins them into one query; the page renders in 0.21 s instead of 4.1 s and the tests pass.",
        ],
        "outputs": [
            "```\nGET /orders  status=200  time=4.12s\nqueries: 501\n  1x SELECT ... FROM shop_order WHERE shop_id = 7 ORDER BY created DESC\n500x SELECT ... FROM shop_customer WHERE id = %s\n```",
            "```python\nfrom django.shortcuts import render\nfrom shop.models import Order\n\n\ndef order_list(request):\n    \"\"\"All orders of the current shop, newest first.\"\"\"\n    orders = Order.objects.filter(shop=request.shop).order_by(\"-created\")\n    rows = []\n    for order in orders:\n        rows.append({\n            \"id\": order.id,\n            \"customer\": order.customer.name,\n            \"total\": order.total,\n            \"created\": order.created,\n        })\n    return render(request, \"orders/list.html\", {\"rows\": rows})\n```",
            "```\npatching file shop/views/orders.py\n```",
            "```\nGET /orders  status=200  time=0.21s\nqueries: 2\n  1x SELECT ... FROM shop_order INNER JOIN shop_customer ON ... WHERE shop_id = 7 ORDER BY created DESC\n  1x SELECT ... FROM django_session WHERE session_key = %s\n```",
            "```\n.........                                                                [100%]\n9 passed in 1.84s\n```",
        ],
    },
    {
        "title": "TypeScript build error after upgrade",
        "task": "After upgrading TypeScript to 5.6, `npm run build` fails. Please make it build again.",
        "replies": [
            "Let me see the error.\n```bash\nnpm run build 2>&1 | tail -20\n```",
            "The error is in `src/api/client.ts`. Let me read the lines around it.\n```bash\nsed -n 20,40p src/api/client.ts\n```",
            "`response.json()` returns `Promise<unknown>` in the new lib types. I will validate the shape before using it.\n```diff\n--- a/src/api/client.ts\n+++ b/src/api/client.ts\n@@ -31,2 +31,5 @@\n-  const data = await response.json();\n-  return data.items;\n+  const data: unknown = await response.json();\n+  if (!isItemList(data)) {\n+    throw new Error(`unexpected response from ${url}`);\n+  }\n+  return data.items;\n```",
            "Now the build again.\n```bash\nnpm run build 2>&1 | tail -5\n```",
            "It builds. Running the unit tests.\n```bash\nnpm test -- --silent\n```",
            "The build works again: TypeScript 5.6 types `response.json()` as `unknown`, so `fetchItems` now checks the payload with the existing `isItemList` guard before reading `items`, and throws a clear error otherwise. All 37 tests pass.",
        ],
        "outputs": [
            "```\n> webapp@2.3.0 build\n> tsc -p tsconfig.json && vite build\n\nsrc/api/client.ts:32:15 - error TS18046: 'data' is of type 'unknown'.\n\n32   return data.items;\n                 ~~~~\n\nFound 1 error in src/api/client.ts:32\n```",
            "```ts\nexport async function fetchItems(url: string): Promise<Item[]> {\n  const response = await fetch(url, { headers: authHeaders() });\n  if (!response.ok) {\n    throw new Error(`GET ${url} failed: ${response.status}`);\n  }\n  const data = await response.json();\n  return data.items;\n}\n\nexport function isItemList(x: unknown): x is { items: Item[] } {\n  return typeof x === \"object\" && x !== null && Array.isArray((x as any).items);\n}\n```",
            "```\npatching file src/api/client.ts\n```",
            "```\nvite v5.4.2 building for production...\n✓ 214 modules transformed.\ndist/index.html                  0.46 kB\ndist/assets/index-4f1c2a.js    148.20 kB │ gzip: 47.91 kB\n✓ built in 2.31s\n```",
            "```\nTest Suites: 9 passed, 9 total\nTests:       37 passed, 37 total\nTime:        3.902 s\n```",
        ],
    },
    {
        "title": "Go race in the cache",
        "task": "`go test -race ./...` reports a data race in package `cache`. Fix it.",
        "replies": [
            "Let me run the race detector on that package.\n```bash\ngo test -race ./internal/cache/ 2>&1 | head -30\n```",
            "`Get` reads the map while `Set` writes it. Let me read the type.\n```bash\nsed -n 1,40p internal/cache/cache.go\n```",
            "`Get` updates `hits` and reads the map without the lock. I will take the mutex there too.\n```diff\n--- a/internal/cache/cache.go\n+++ b/internal/cache/cache.go\n@@ -24,2 +24,4 @@ func (c *Cache) Get(key string) (string, bool) {\n+\tc.mu.Lock()\n+\tdefer c.mu.Unlock()\n \te, ok := c.items[key]\n```",
            "Running the race detector again.\n```bash\ngo test -race ./internal/cache/\n```",
            "Clean. Now all packages.\n```bash\ngo test -race ./...\n```",
            "Running vet as well.\n```bash\ngo vet ./...\n```",
            "Fixed the race: `Cache.Get` read the map and incremented `hits` without holding `c.mu`, while `Set` wrote the map under it. `Get` now takes the mutex as well. `go test -race ./...` and `go vet` are clean.",
        ],
        "outputs": [
            "```\n==================\nWARNING: DATA RACE\nRead at 0x00c0001a2030 by goroutine 9:\n  example.com/app/internal/cache.(*Cache).Get()\n      /src/internal/cache/cache.go:25 +0x64\nPrevious write at 0x00c0001a2030 by goroutine 8:\n  example.com/app/internal/cache.(*Cache).Set()\n      /src/internal/cache/cache.go:37 +0xb4\n==================\n--- FAIL: TestConcurrentAccess (0.01s)\n    testing.go:1398: race detected during execution of test\nFAIL\n```",
            "```go\npackage cache\n\nimport (\n\t\"sync\"\n\t\"time\"\n)\n\ntype entry struct {\n\tvalue   string\n\texpires time.Time\n}\n\ntype Cache struct {\n\tmu    sync.Mutex\n\titems map[string]entry\n\thits  int\n}\n\nfunc (c *Cache) Get(key string) (string, bool) {\n\te, ok := c.items[key]\n\tif !ok || time.Now().After(e.expires) {\n\t\treturn \"\", false\n\t}\n\tc.hits++\n\treturn e.value, true\n}\n```",
            "```\npatching file internal/cache/cache.go\n```",
            "```\nok  \texample.com/app/internal/cache\t1.214s\n```",
            "```\nok  \texample.com/app/cmd/server\t0.842s\nok  \texample.com/app/internal/api\t2.107s\nok  \texample.com/app/internal/cache\t1.198s\nok  \texample.com/app/internal/store\t3.561s\n```",
            "```\n(no output)\n```",
        ],
    },
    {
        "title": "rename a config key",
        "task": "Rename the config key `timeout` to `timeout_s` everywhere, but keep reading the old name with a deprecation warning so old config files still work.",
        "replies": [
            "Let me find every use of the key.\n```bash\ngrep -rn \"timeout\" --include=*.py src tests | grep -v timeout_s\n```",
            "The key is read in `src/svc/config.py`. Let me read the loader.\n```bash\nsed -n 1,35p src/svc/config.py\n```",
            "I will read `timeout_s` and fall back to `timeout` with a warning.\n```diff\n--- a/src/svc/config.py\n+++ b/src/svc/config.py\n@@ -18 +18,6 @@\n-    timeout = float(raw.get(\"timeout\", 30))\n+    if \"timeout\" in raw and \"timeout_s\" not in raw:\n+        warnings.warn(\"config key 'timeout' is deprecated; use 'timeout_s'\", DeprecationWarning)\n+        timeout = float(raw[\"timeout\"])\n+    else:\n+        timeout = float(raw.get(\"timeout_s\", 30))\n```",
            "Updating the example config and running the tests.\n```bash\nsed -i 's/^timeout:/timeout_s:/' config.example.yaml && pytest -q\n```",
            "One test still writes the old key and now warns. Let me see it.\n```bash\npytest -q -W error::DeprecationWarning tests/test_config.py\n```",
            "That test checks the old key on purpose, so I will make it expect the warning.\n```diff\n--- a/tests/test_config.py\n+++ b/tests/test_config.py\n@@ -22,2 +22,3 @@ def test_old_timeout_key(tmp_path):\n-    cfg = load(write(tmp_path, \"timeout: 5\"))\n+    with pytest.warns(DeprecationWarning, match=\"timeout_s\"):\n+        cfg = load(write(tmp_path, \"timeout: 5\"))\n```",
            "Running the suite with warnings as errors.\n```bash\npytest -q -W error::DeprecationWarning\n```",
            "The key is now `timeout_s`; `load` still accepts `timeout` and emits a DeprecationWarning that names the new key. The example config uses the new name and the test of the old key expects the warning. All tests pass with warnings as errors.",
        ],
        "outputs": [
            "```\nsrc/svc/config.py:18:    timeout = float(raw.get(\"timeout\", 30))\nsrc/svc/client.py:44:        resp = self.session.get(url, timeout=self.cfg.timeout)\ntests/test_config.py:23:    cfg = load(write(tmp_path, \"timeout: 5\"))\ntests/test_config.py:24:    assert cfg.timeout == 5\n```",
            "```python\nimport warnings\nfrom dataclasses import dataclass\nfrom pathlib import Path\n\nimport yaml\n\n\n@dataclass(frozen=True)\nclass Config:\n    url: str\n    timeout: float\n    retries: int\n\n\ndef load(path: Path) -> Config:\n    raw = yaml.safe_load(path.read_text()) or {}\n    url = raw[\"url\"]\n    timeout = float(raw.get(\"timeout\", 30))\n    retries = int(raw.get(\"retries\", 3))\n    return Config(url, timeout, retries)\n```",
            "```\npatching file src/svc/config.py\n```",
            "```\n..........                                                               [100%]\n=============================== warnings summary ===============================\ntests/test_config.py::test_old_timeout_key\n  src/svc/config.py:19: DeprecationWarning: config key 'timeout' is deprecated; use 'timeout_s'\n10 passed, 1 warning in 0.35s\n```",
            "```\n..F                                                                      [100%]\nE       DeprecationWarning: config key 'timeout' is deprecated; use 'timeout_s'\n1 failed, 2 passed in 0.11s\n```",
            "```\npatching file tests/test_config.py\n```",
            "```\n..........                                                               [100%]\n10 passed in 0.33s\n```",
        ],
    },
    {
        "title": "off-by-one in pagination",
        "task": "Users report that the last item of every page also shows up as the first item of the next page. Fix the pagination.",
        "replies": [
            "Let me find the pagination code.\n```bash\ngrep -rn \"def paginate\" -A 12 src/\n```",
            "The slice end is `start + size + 1`, one too many. Let me check the tests first.\n```bash\npytest -q tests/test_paging.py\n```",
            "The tests only check the first page. I will add one for page boundaries, then fix the slice.\n```diff\n--- a/src/catalog/paging.py\n+++ b/src/catalog/paging.py\n@@ -6 +6 @@\n-    return items[start:start + size + 1]\n+    return items[start:start + size]\n--- a/tests/test_paging.py\n+++ b/tests/test_paging.py\n@@ -12,0 +13,4 @@\n+def test_pages_do_not_overlap():\n+    items = list(range(10))\n+    pages = [paginate(items, p, 3) for p in range(1, 5)]\n+    assert sum(pages, []) == items\n```",
            "Running the paging tests.\n```bash\npytest -q tests/test_paging.py\n```",
            "Passing. The API test of the last page next.\n```bash\npytest -q tests/test_api.py -k page\n```",
            "The slice in `paginate` took `size + 1` items, so each page repeated the next page's first item. It now takes `size`, and a new test checks that consecutive pages cover the list exactly once.",
        ],
        "outputs": [
            "```\nsrc/catalog/paging.py:1:def paginate(items, page, size):\n    \"\"\"Items of a 1-based page.\"\"\"\n    if page < 1 or size < 1:\n        raise ValueError(\"page and size must be >= 1\")\n    start = (page - 1) * size\n    return items[start:start + size + 1]\n```",
            "```\n...                                                                      [100%]\n3 passed in 0.02s\n```",
            "```\npatching file src/catalog/paging.py\npatching file tests/test_paging.py\n```",
            "```\n....                                                                     [100%]\n4 passed in 0.02s\n```",
            "```\n..                                                                       [100%]\n2 passed, 14 deselected in 0.48s\n```",
        ],
    },
    {
        "title": "Rust borrow checker error",
        "task": "My change to `src/inventory.rs` does not compile. I want `restock` to update every item below the threshold. Can you help?",
        "replies": [
            "Let me see the compiler error.\n```bash\ncargo build 2>&1 | head -25\n```",
            "The loop borrows `self.items` immutably while `self.order` needs `&mut self`. Let me read the function.\n```bash\ngrep -n \"fn restock\" -A 12 src/inventory.rs\n```",
            "I will collect the names first, then mutate.\n```diff\n--- a/src/inventory.rs\n+++ b/src/inventory.rs\n@@ -41,5 +41,9 @@\n-        for item in self.items.iter() {\n-            if item.count < threshold {\n-                self.order(&item.name, threshold - item.count);\n-            }\n-        }\n+        let low: Vec<(String, u32)> = self.items.iter()\n+            .filter(|i| i.count < threshold)\n+            .map(|i| (i.name.clone(), threshold - i.count))\n+            .collect();\n+        for (name, n) in low {\n+            self.order(&name, n);\n+        }\n```",
            "Building again.\n```bash\ncargo build 2>&1 | tail -3\n```",
            "It compiles. Running the tests.\n```bash\ncargo test 2>&1 | tail -8\n```",
            "Running clippy too.\n```bash\ncargo clippy -- -D warnings 2>&1 | tail -3\n```",
            "`restock` borrowed `self.items` for the loop while calling `self.order`, which needs `&mut self`. It now collects the low items' names and amounts first and orders them afterwards. It builds, the tests pass and clippy is clean.",
        ],
        "outputs": [
            "```\n   Compiling shopkeeper v0.4.1 (/src)\nerror[E0502]: cannot borrow `*self` as mutable because it is also borrowed as immutable\n  --> src/inventory.rs:44:17\n   |\n41 |         for item in self.items.iter() {\n   |                     -----------------\n   |                     |\n   |                     immutable borrow occurs here\n   |                     immutable borrow later used here\n...\n44 |                 self.order(&item.name, threshold - item.count);\n   |                 ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^ mutable borrow occurs here\n\nerror: could not compile `shopkeeper` (lib) due to 1 previous error\n```",
            "```\n40:    pub fn restock(&mut self, threshold: u32) {\n41:        for item in self.items.iter() {\n42:            if item.count < threshold {\n43:                self.order(&item.name, threshold - item.count);\n44:            }\n45:        }\n46:    }\n```",
            "```\npatching file src/inventory.rs\n```",
            "```\n   Compiling shopkeeper v0.4.1 (/src)\n    Finished `dev` profile [unoptimized + debuginfo] target(s) in 1.84s\n```",
            "```\nrunning 12 tests\ntest inventory::tests::restock_orders_low_items ... ok\ntest inventory::tests::restock_ignores_full_items ... ok\ntest orders::tests::order_total ... ok\n\ntest result: ok. 12 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.01s\n```",
            "```\n    Checking shopkeeper v0.4.1 (/src)\n    Finished `dev` profile [unoptimized + debuginfo] target(s) in 0.93s\n```",
        ],
    },
    {
        "title": "missing dependency in CI",
        "task": "The CI job `lint` fails with an import error, but the tests pass. What is wrong?",
        "replies": [
            "Let me look at the lint job's log.\n```bash\ncat ci-logs/lint.txt | tail -15\n```",
            "`mypy` cannot find `types-requests`. Let me check how the lint job installs packages.\n```bash\ncat .github/workflows/lint.yml\n```",
            "The job installs only `requirements.txt`; the stubs are in `requirements-dev.txt`. Let me check that file.\n```bash\ncat requirements-dev.txt\n```",
            "The stubs are listed there, so the job should install the dev requirements.\n```diff\n--- a/.github/workflows/lint.yml\n+++ b/.github/workflows/lint.yml\n@@ -14 +14 @@\n-      - run: pip install -r requirements.txt\n+      - run: pip install -r requirements.txt -r requirements-dev.txt\n```",
            "Running the same lint step locally in a fresh venv.\n```bash\npython -m venv /tmp/lint && /tmp/lint/bin/pip install -q -r requirements.txt -r requirements-dev.txt && /tmp/lint/bin/mypy src\n```",
            "The lint job installed only `requirements.txt`, so mypy ran without the `types-requests` stubs from `requirements-dev.txt` and reported a missing import. The workflow now installs both files; mypy is clean locally in a fresh venv.",
        ],
        "outputs": [
            "```\nRun mypy src\nsrc/sync/http.py:3: error: Library stubs not installed for \"requests\"  [import-untyped]\nsrc/sync/http.py:3: note: Hint: \"python3 -m pip install types-requests\"\nsrc/sync/http.py:3: note: (or run \"mypy --install-types\" to install all missing stub packages)\nFound 1 error in 1 file (checked 23 source files)\nError: Process completed with exit code 1.\n```",
            "```yaml\nname: lint\non: [push, pull_request]\njobs:\n  lint:\n    runs-on: ubuntu-latest\n    steps:\n      - uses: actions/checkout@v4\n      - uses: actions/setup-python@v5\n        with:\n          python-version: \"3.12\"\n      - run: pip install -r requirements.txt\n      - run: ruff check src tests\n      - run: mypy src\n```",
            "```\nmypy==1.13.0\nruff==0.7.2\npytest==8.3.3\ntypes-requests==2.32.0.20241016\n```",
            "```\npatching file .github/workflows/lint.yml\n```",
            "```\nSuccess: no issues found in 23 source files\n```",
        ],
    },
    {
        "title": "memory grows in the worker",
        "task": "Our background worker's memory grows by about 50 MB an hour until it is killed. Can you find the leak?",
        "replies": [
            "Let me look for caches or module-level lists in the worker.\n```bash\ngrep -rn \"lru_cache\\|_cache\\s*=\\|= \\[\\]\\|= {}\" worker/ | grep -v test\n```",
            "`_seen` in `worker/dedup.py` is a module-level set that only grows. Let me read it.\n```bash\ncat worker/dedup.py\n```",
            "Every message id is kept forever. I will bound it with an ordered dict that forgets the oldest ids.\n```diff\n--- a/worker/dedup.py\n+++ b/worker/dedup.py\n@@ -1,9 +1,14 @@\n-_seen = set()\n+from collections import OrderedDict\n+\n+MAX_IDS = 100_000\n+_seen: OrderedDict[str, None] = OrderedDict()\n \n \n def is_duplicate(msg_id: str) -> bool:\n     if msg_id in _seen:\n         return True\n-    _seen.add(msg_id)\n+    _seen[msg_id] = None\n+    if len(_seen) > MAX_IDS:\n+        _seen.popitem(last=False)\n     return False\n```",
            "Running the worker tests.\n```bash\npytest -q tests/worker\n```",
            "Checking memory with a quick soak run of one million messages.\n```bash\npython scripts/soak.py --messages 1000000\n```",
            "Found it: `worker/dedup.py` remembered every message id in a module-level set, so memory grew with traffic. It now keeps the last 100,000 ids in an ordered dict; a soak run of a million messages stays flat at about 61 MB, and the tests pass.",
        ],
        "outputs": [
            "```\nworker/dedup.py:1:_seen = set()\nworker/handlers.py:12:@functools.lru_cache(maxsize=128)\nworker/metrics.py:8:_counters = {}\n```",
            "```python\n_seen = set()\n\n\ndef is_duplicate(msg_id: str) -> bool:\n    \"\"\"True if this message id was handled before (queues may deliver twice).\"\"\"\n    if msg_id in _seen:\n        return True\n    _seen.add(msg_id)\n    return False\n```",
            "```\npatching file worker/dedup.py\n```",
            "```\n..............                                                           [100%]\n14 passed in 0.52s\n```",
            "```\nmessages: 1000000  duplicates: 2114  rss start: 58.3 MB  rss end: 61.0 MB  rate: 41200 msg/s\n```",
        ],
    },
    {
        "title": "unicode file names crash the uploader",
        "task": "Uploading a file called `résumé.pdf` crashes the upload script with a UnicodeEncodeError. Please fix it.",
        "replies": [
            "Let me reproduce it.\n```bash\npython upload.py samples/résumé.pdf\n```",
            "The header is built with `latin-1`. Let me read that function.\n```bash\ngrep -n \"def content_disposition\" -A 8 upload.py\n```",
            "I will use RFC 5987 encoding for the file name, with an ASCII fallback.\n```diff\n--- a/upload.py\n+++ b/upload.py\n@@ -20,3 +20,5 @@ def content_disposition(name):\n-    return f'attachment; filename=\"{name}\"'.encode(\"latin-1\")\n+    ascii_name = name.encode(\"ascii\", \"replace\").decode().replace(\"?\", \"_\")\n+    quoted = urllib.parse.quote(name)\n+    return f\"attachment; filename=\\\"{ascii_name}\\\"; filename*=UTF-8''{quoted}\".encode(\"ascii\")\n```",
            "Trying the upload again.\n```bash\npython upload.py samples/résumé.pdf\n```",
            "Running the tests, including one with a non-ASCII name.\n```bash\npytest -q tests/test_upload.py\n```",
            "`content_disposition` encoded the header as latin-1, which fails for names outside it. It now sends an ASCII fallback name plus the RFC 5987 `filename*=UTF-8''...` form, so `résumé.pdf` uploads under its real name. The tests pass.",
        ],
        "outputs": [
            "```\nTraceback (most recent call last):\n  File \"/src/upload.py\", line 58, in <module>\n    main(sys.argv[1:])\n  File \"/src/upload.py\", line 51, in main\n    headers = {\"Content-Disposition\": content_disposition(path.name)}\n  File \"/src/upload.py\", line 22, in content_disposition\n    return f'attachment; filename=\"{name}\"'.encode(\"latin-1\")\nUnicodeEncodeError: 'latin-1' codec can't encode character '\\u0301' in position 23: ordinal not in range(256)\n```",
            "```\n20:def content_disposition(name):\n21-    \"\"\"The Content-Disposition header for an uploaded file.\"\"\"\n22-    return f'attachment; filename=\"{name}\"'.encode(\"latin-1\")\n```",
            "```\npatching file upload.py\n```",
            "```\nuploading samples/résumé.pdf (48.2 kB) ... done: https://files.example.com/f/8d41c2\n```",
            "```\n.....                                                                    [100%]\n5 passed in 0.21s\n```",
        ],
    },
]
