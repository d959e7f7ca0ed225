"""Length checks at submission: a task whose `max_seq_len` would leave rows without a target token is refused (422
`rows_truncated`, param `max_seq_len`, naming the rows, their length percentiles and a `max_seq_len` that works)
before anything runs; one that only shortens rows gets a `task.rows_truncated` warning event.

A file's lengths under a model's tokenizer are counted once, at the first submission that pairs them (the file
streamed from the artifact store, its first `MAX_COUNTED_ROWS` rows), and kept in `file_token_lengths` in a
transaction of their own, so that a dry run keeps them too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import jinja2
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.errors import ApiError, invalid
from common.artifacts import get_artifact_store
from common.datasets import parse_line
from common.db import session_scope
from common.events import record_event
from common.model_tokenizers import load_tokenizer
from common.tables import BaseModelEntry, File, FileTokenLengths, Task
from common.token_lengths import (
    MAX_COUNTED_ROWS,
    ChatTokenizer,
    FileLengths,
    RowLength,
    Truncation,
    row_length,
    truncation,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shortened:
    """A file of the task whose rows `max_seq_len` shortens (each keeps a target token)."""

    field: str
    file_id: str
    truncation: Truncation


def check_row_lengths(session: Session, model: BaseModelEntry, files: list[tuple[str, File]],
                      max_seq_len: int) -> list[Shortened]:
    """Refuses a `max_seq_len` that leaves a counted row of any of `files` ((field, file) pairs) without a target
    token; returns the files whose rows it shortens. A model whose tokenizer cannot be built here is not checked."""
    tok = load_tokenizer(model.kind, model.path, model.package, model.gguf_file)
    if tok is None:
        log.info("model %s: no tokenizer to count with here; row lengths are not checked", model.name)
        return []
    shortened = []
    for field, file in files:
        try:
            lengths = file_lengths(session, file, model.name, tok, field)
        except OSError:  # its content gone from the store (a fault): the worker will say so; nothing to count here
            log.warning("file %s could not be read to count its rows' tokens", file.id, exc_info=True)
            continue
        cut = truncation(lengths, max_seq_len)
        if cut.without_target:
            raise _rows_truncated(field, file, model, lengths, cut)
        if cut.shortened:
            shortened.append(Shortened(field=field, file_id=file.id, truncation=cut))
    return shortened


def _rows_truncated(field: str, file: File, model: BaseModelEntry, lengths: FileLengths, cut: Truncation) -> ApiError:
    scope = (f"the first {lengths.counted} of its {lengths.total} rows" if lengths.capped
             else f"its {lengths.counted} rows")
    advice = (f"Give max_seq_len {cut.shortest_working} or more (every row keeps a target token; {cut.longest} "
              "truncates none)")
    if model.max_context is not None and cut.shortest_working > model.max_context:
        advice = (f"No max_seq_len within the model's context ({model.max_context} tokens) keeps a target token "
                  f"in every row ({cut.shortest_working} would); shorten those rows' prompts")
    return invalid(
        f"max_seq_len {cut.max_seq_len} leaves {cut.without_target} row(s) of {field} '{file.id}' without a target "
        f"token (their prompt alone fills it), and the worker would drop them. Row lengths under model "
        f"'{model.name}', over {scope}: p50 {cut.p50}, p90 {cut.p90}, max {cut.longest} tokens. {advice}.",
        param="max_seq_len", code="rows_truncated", file=file.id, rows_without_target=cut.without_target,
        rows_counted=cut.counted, length_p50=cut.p50, length_p90=cut.p90, length_max=cut.longest,
        suggested_max_seq_len=cut.shortest_working,
    )


def record_shortened(session: Session, task: Task, shortened: list[Shortened]) -> None:
    """A warning event per file whose rows the task's max_seq_len shortens."""
    for s in shortened:
        cut = s.truncation
        record_event(
            session, tenant_id=task.tenant_id, task_id=task.id, type="task.rows_truncated", level="warning",
            message=(f"max_seq_len {cut.max_seq_len} shortens {cut.shortened} of {cut.counted} rows of {s.field} "
                     f"'{s.file_id}' (each keeps a target token; p50 {cut.p50}, p90 {cut.p90}, max {cut.longest} "
                     f"tokens); max_seq_len {cut.longest} would truncate none."),
            data={"file": s.file_id, "field": s.field, "rows_shortened": cut.shortened, "rows_counted": cut.counted,
                  "length_p50": cut.p50, "length_p90": cut.p90, "length_max": cut.longest},
        )


def file_lengths(session: Session, file: File, model_name: str, tok: ChatTokenizer, field: str) -> FileLengths:
    """The file's lengths under `tok`: stored, or counted now and stored."""
    stored = session.scalar(select(FileTokenLengths.lengths).where(
        FileTokenLengths.file_id == file.id, FileTokenLengths.base_model == model_name,
        FileTokenLengths.tokenizer == tok.fingerprint))
    if stored is not None:
        return FileLengths.from_stored(stored)
    lengths = FileLengths.of(_count_rows(file, tok, field), total=file.rows)
    try:
        with session_scope() as own:  # its own transaction: kept whatever the submission's fate (a dry run too)
            own.add(FileTokenLengths(file_id=file.id, base_model=model_name, tokenizer=tok.fingerprint,
                                     lengths=lengths.to_stored()))
    except IntegrityError:
        pass  # a concurrent submission stored the same lengths first
    return lengths


def _count_rows(file: File, tok: ChatTokenizer, field: str) -> Iterator[RowLength]:
    """Each of the file's first MAX_COUNTED_ROWS rows' lengths, the file streamed a line at a time (a line is at most
    `MAX_LINE_BYTES`: the upload checked)."""
    counted = 0
    with get_artifact_store().open(file.storage_key) as f:
        for number, line in enumerate(f, start=1):
            if counted >= MAX_COUNTED_ROWS:
                return
            row = parse_line(line)
            if row is None:
                continue
            try:
                yield row_length(row, tok)
            except (ValueError, jinja2.TemplateError) as exc:
                raise invalid(f"Line {number} of {field} '{file.id}' cannot be encoded for this model: {exc}",
                              param=field, code="invalid_file") from exc
            counted += 1
