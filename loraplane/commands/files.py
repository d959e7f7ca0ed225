"""`loraplane login`, `loraplane files ...` and `loraplane models`."""

from __future__ import annotations

import argparse
import getpass
import sys

from loraplane.client import Client, File, config_path, resolve, write_config
from loraplane.commands.base import (
    UsageError,
    common_options,
    emit,
    guarded,
    make_client,
    out,
    size,
    table,
    when,
)


def _ask_url() -> str:
    default = resolve().base_url
    if not sys.stdin.isatty():
        return default
    return input(f"API URL [{default}]: ").strip() or default


def _ask_key() -> str:
    """Hidden on a terminal; otherwise one line from stdin (`echo $KEY | loraplane login`)."""
    if sys.stdin.isatty():
        return getpass.getpass("API key: ").strip()
    return sys.stdin.readline().strip()


def cmd_login(args: argparse.Namespace) -> int:
    url = args.api_url or _ask_url()
    key = args.api_key or _ask_key()
    if not key:
        raise UsageError("no API key given (--api-key, or type it when asked)")
    with Client(url, key) as lp:
        models = lp.models.list()  # a call that needs a valid key: a wrong one is refused here (401)
        url = lp.base_url
    path = write_config(url, key, config_path())
    if args.json:
        emit({"api_url": url, "config_file": str(path)})
    else:
        out(f"Logged in to {url} with key {key[:12]}... ({len(models)} base models available).")
        out(f"Saved to {path} (readable by you only).")
    return 0


def _file_line(f: File) -> str:
    return f"{f.id}  {f.filename}: {f.rows} rows ({f.format}), {size(f.bytes)}"


def cmd_files_upload(args: argparse.Namespace) -> int:
    try:
        data = open(args.path, "rb")  # noqa: SIM115 - closed below; opened first for a clear local error
    except OSError as exc:
        raise UsageError(f"{args.path}: {exc.strerror or exc}") from exc
    with data, make_client(args) as lp:
        f = lp.files.upload(data, purpose=args.purpose)
    if args.json:
        emit(f.raw)
    else:
        out(_file_line(f))
    return 0


def _files_table(files: list[File]) -> str:
    rows = [[f.id, f.filename, f.rows, f.format, size(f.bytes), when(f.created_at)] for f in files]
    return table(["ID", "FILENAME", "ROWS", "FORMAT", "SIZE", "CREATED"], rows, right=(2, 4))


def cmd_files_list(args: argparse.Namespace) -> int:
    with make_client(args) as lp:
        files = lp.files.list(limit=args.limit, after=args.after)
    if args.json:
        emit(files.raw)
        return 0
    out(_files_table(files.data) if files.data else "No files.")
    if files.has_more:
        out(f"(more: --after {files.next_after})")
    return 0


def cmd_files_show(args: argparse.Namespace) -> int:
    with make_client(args) as lp:
        f = lp.files.get(args.file_id)
    if args.json:
        emit(f.raw)
    else:
        out(_files_table([f]) + f"\nsha256 {f.sha256}")
    return 0


def cmd_files_delete(args: argparse.Namespace) -> int:
    with make_client(args) as lp:
        deleted = lp.files.delete(args.file_id)
    if args.json:
        emit(deleted.raw)
    else:
        out(f"Deleted {deleted.id}.")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    with make_client(args) as lp:
        if args.name:
            model = lp.models.get(args.name)
            models = [model]
            raw = model.raw
        else:
            page = lp.models.list()
            models, raw = page.data, page.raw
    if args.json:
        emit(raw)
        return 0
    rows = [[m.id, m.kind, "-" if m.parameters is None else f"{m.parameters / 1e6:.1f}M", m.description]
            for m in models]
    out(table(["ID", "KIND", "PARAMS", "DESCRIPTION"], rows, right=(2,)))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    common = common_options()
    login = sub.add_parser("login", parents=[common], help="store the API's URL and your API key (checked first)",
                           description="Asks for the API's URL and your API key (or takes them as options), checks "
                                       "them against the API, and stores them in the config file (mode 0600) that "
                                       "the other commands read.")
    login.set_defaults(func=guarded(cmd_login), client=True)

    files = sub.add_parser("files", help="upload and list datasets (JSONL)")
    files_sub = files.add_subparsers(dest="files_command", required=True, metavar="COMMAND")
    upload = files_sub.add_parser("upload", parents=[common], help="upload a JSONL dataset (every row is checked)")
    upload.add_argument("path")
    upload.add_argument("--purpose", default="fine-tune")
    upload.set_defaults(func=guarded(cmd_files_upload), client=True)
    ls = files_sub.add_parser("list", parents=[common], help="your files, newest first")
    ls.add_argument("--limit", type=int, default=None, help="at most this many (API default 20, max 100)")
    ls.add_argument("--after", metavar="FILE_ID", help="the page after this file")
    ls.set_defaults(func=guarded(cmd_files_list), client=True)
    show = files_sub.add_parser("show", parents=[common], help="one file")
    show.add_argument("file_id")
    show.set_defaults(func=guarded(cmd_files_show), client=True)
    delete = files_sub.add_parser("delete", parents=[common], help="delete a file no running task uses")
    delete.add_argument("file_id")
    delete.set_defaults(func=guarded(cmd_files_delete), client=True)

    models = sub.add_parser("models", parents=[common], help="the base models tasks can tune")
    models.add_argument("name", nargs="?", help="show this model only")
    models.set_defaults(func=guarded(cmd_models), client=True)
