"""`loraplane sample TASK_ID PROMPT`: an answer from a task's best trial (or `--trial`'s), sampled by a worker."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from loraplane.commands.base import common_options, emit, guarded, make_client, out


def cmd_sample(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    text_input: dict[str, Any] = ({"messages": [{"role": "user", "content": prompt}]} if args.chat
                                  else {"prompt": prompt})
    sampling = {k: v for k, v in {"max_tokens": args.max_tokens, "temperature": args.temperature,
                                  "top_p": args.top_p, "seed": args.seed, "stop": args.stop}.items() if v is not None}
    with make_client(args) as lp:
        if args.json or args.no_stream:
            completion = lp.tasks.complete(args.task_id, trial_id=args.trial, **text_input, **sampling)
            if args.json:
                emit(completion.raw)
            else:
                out(completion.text)
            return 0
        for piece in lp.tasks.complete_stream(args.task_id, trial_id=args.trial, **text_input, **sampling):
            sys.stdout.write(piece)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sample = sub.add_parser(
        "sample", parents=[common_options()], help="an answer from a task's best (or a trial's) adapter",
        description="Samples an answer from the task's best trial so far (or --trial's) on a worker, printed as it "
                    "comes. The prompt is encoded as the task's prompt/completion rows' prompts, or with --chat as a "
                    "user message under the model's chat template.")
    sample.add_argument("task_id")
    sample.add_argument("prompt", help="the prompt, or - to read it from stdin")
    sample.add_argument("--trial", metavar="TRIAL_ID", help="this trial's adapter instead of the best one")
    sample.add_argument("--chat", action="store_true", help="send the prompt as a chat user message")
    sample.add_argument("--max-tokens", type=int, default=None, help="new tokens at most (API default 256)")
    sample.add_argument("--temperature", type=float, default=None, help="0: greedy (API default 1)")
    sample.add_argument("--top-p", type=float, default=None)
    sample.add_argument("--seed", type=int, default=None, help="the same seed gives the same answer")
    sample.add_argument("--stop", action="append", default=None, metavar="TEXT", help="ends the answer (up to 4)")
    sample.add_argument("--no-stream", action="store_true", help="print the answer once it is whole")
    sample.set_defaults(func=guarded(cmd_sample), client=True)
