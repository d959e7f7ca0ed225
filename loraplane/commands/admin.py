"""`loraplane admin tenants|keys|usage|workers|models`: the operator's commands (the admin token)."""

from __future__ import annotations

import argparse

from loraplane.client import ApiKey, Client, RegisteredModel, Tenant
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
from loraplane.commands.usage import usage_table, window_options


def _admin(args: argparse.Namespace) -> Client:
    lp = make_client(args, admin=True)
    if not lp.admin_token:
        lp.close()
        raise UsageError("no admin token: give --admin-token or set LORAPLANE_ADMIN_TOKEN")
    return lp


def _all_tenants(lp: Client, *, include_deleted: bool = False) -> list[Tenant]:
    tenants: list[Tenant] = []
    after = None
    while True:
        page = lp.admin.list_tenants(limit=100, after=after, include_deleted=include_deleted)
        tenants += page.data
        if not page.has_more:
            return tenants
        after = page.next_after


def _tenant_id(lp: Client, ref: str) -> str:
    """A tenant id as given, or the id of the tenant with that name."""
    if ref.startswith("tenant-"):
        return ref
    found = [t.id for t in _all_tenants(lp) if t.name == ref]
    if not found:
        raise UsageError(f"no tenant named {ref!r} (give its name or its id)")
    return found[0]


def _tenants_table(tenants: list[Tenant]) -> str:
    rows = [[t.id, t.name, f"{t.weight:g}", t.max_concurrent_trials, t.max_trials_per_task, size(t.max_file_bytes),
             size(t.max_storage_bytes), t.max_files, when(t.created_at)] for t in tenants]
    headers = ["ID", "NAME", "WEIGHT", "MAX ACTIVE TRIALS", "MAX TRIALS/TASK", "MAX FILE", "MAX STORAGE", "MAX FILES",
               "CREATED"]
    if any(t.deleted_at for t in tenants):  # only a list with --include-deleted shows deleted ones
        headers.append("DELETED")
        for row, t in zip(rows, tenants, strict=True):
            row.append(when(t.deleted_at) if t.deleted_at else "")
    return table(headers, rows, right=(2, 3, 4, 5, 6, 7))


def _tenant_deleted(tenant: Tenant) -> str:
    return (f"Deleted tenant {tenant.name} ({tenant.id}) at {when(tenant.deleted_at)}: its API keys are revoked, its "
            "queued and running tasks cancelled, its webhooks removed. Its usage, finished tasks, files and name "
            "are kept.")


def cmd_tenants(args: argparse.Namespace) -> int:
    with _admin(args) as lp:
        if args.action == "create":
            tenant = lp.admin.create_tenant(
                args.name, weight=args.weight, max_concurrent_trials=args.max_concurrent_trials,
                max_trials_per_task=args.max_trials_per_task, max_file_bytes=args.max_file_bytes,
                max_storage_bytes=args.max_storage_bytes, max_files=args.max_files)
            tenants, raw = [tenant], tenant.raw
        elif args.action == "show":
            tenant = lp.admin.get_tenant(_tenant_id(lp, args.tenant))
            tenants, raw = [tenant], tenant.raw
        elif args.action == "delete":
            tenant = lp.admin.delete_tenant(_tenant_id(lp, args.tenant))
            if args.json:
                emit(tenant.raw)
            else:
                out(_tenant_deleted(tenant))
            return 0
        else:
            page = lp.admin.list_tenants(limit=args.limit, after=args.after, include_deleted=args.include_deleted)
            tenants, raw = page.data, page.raw
    if args.json:
        emit(raw)
        return 0
    out(_tenants_table(tenants) if tenants else "No tenants.")
    if args.action == "create":
        out(f"\nnext: loraplane admin keys create {tenants[0].name}")
    return 0


def _keys_table(keys: list[ApiKey], names: dict[str, str]) -> str:
    rows = [[k.id, names.get(k.tenant_id, k.tenant_id), k.prefix + "...", k.name, when(k.created_at),
             when(k.revoked_at) if k.revoked_at else ""] for k in keys]
    return table(["ID", "TENANT", "PREFIX", "NAME", "CREATED", "REVOKED"], rows)


def cmd_keys(args: argparse.Namespace) -> int:
    with _admin(args) as lp:
        if args.action == "create":
            key = lp.admin.create_api_key(_tenant_id(lp, args.tenant), name=args.name)
            if args.json:
                emit(key.raw)
            else:
                out(f"Created {key.id} for {args.tenant}. The key, shown only this once:\n\n    {key.key}\n")
                out(f"Use it with: loraplane login --api-key {key.prefix}...")
            return 0
        if args.action == "revoke":
            key = lp.admin.revoke_api_key(args.key_id)
            if args.json:
                emit(key.raw)
            else:
                out(f"Revoked {key.id} ({key.prefix}...) at {when(key.revoked_at)}.")
            return 0
        if args.tenant:
            tenant = lp.admin.get_tenant(_tenant_id(lp, args.tenant))
            tenants = [tenant]
        else:
            tenants = _all_tenants(lp)
        pages = [lp.admin.list_api_keys(t.id) for t in tenants]
    keys = [k for page in pages for k in page]
    if args.json:
        emit({"object": "list", "data": [k.raw for k in keys], "has_more": False})
        return 0
    out(_keys_table(keys, {t.id: t.name for t in tenants}) if keys else "No API keys.")
    return 0


def cmd_usage(args: argparse.Namespace) -> int:
    with _admin(args) as lp:
        usage = lp.admin.usage(start=args.start, end=args.end)
        names = {t.id: t.name for t in _all_tenants(lp, include_deleted=True)}  # a deleted tenant's usage stays
    if args.json:
        emit(usage.raw)
        return 0
    out(usage_table(usage.data, names) if usage.data else "No tenants.")
    return 0


def cmd_workers(args: argparse.Namespace) -> int:
    with _admin(args) as lp:
        workers = lp.admin.list_workers()
    if args.json:
        emit(workers.raw)
        return 0
    # A quarantined worker (it lost packs repeatedly) gets no pack until then.
    # WARM: the base models it holds loaded (a pack of one starts without loading it), most recently used first.
    rows = [[w.id, w.state if w.quarantined_until is None else f"quarantined until {when(w.quarantined_until)}",
             w.device, w.max_slots, size(w.memory_bytes), w.current_pack_id or "-",
             ",".join(m["name"] for m in w.warm_models or ()) or "-", when(w.last_heartbeat)]
            for w in workers]
    out(table(["ID", "STATE", "DEVICE", "SLOTS", "MEMORY", "PACK", "WARM", "LAST HEARTBEAT"], rows, right=(3, 4))
        if rows else "No workers.")
    return 0


def _models_table(models: list[RegisteredModel], names: dict[str, str]) -> str:
    rows = [[m.name, m.kind, m.architecture or "-", m.max_context or "-",
             "-" if m.chat_template is None else "yes" if m.chat_template else "no",
             "all" if m.tenants is None else ", ".join(names.get(t, t) for t in m.tenants) or "none",
             m.path or "-", when(m.created_at)] for m in models]
    headers = ["NAME", "KIND", "ARCHITECTURE", "CONTEXT", "CHAT TEMPLATE", "TENANTS", "PATH", "CREATED"]
    if any(m.deleted_at for m in models):  # only a list with --include-deleted shows retired ones
        headers.append("RETIRED")
        for row, m in zip(rows, models, strict=True):
            row.append(when(m.deleted_at) if m.deleted_at else "")
    return table(headers, rows, right=(3,))


def cmd_models(args: argparse.Namespace) -> int:
    with _admin(args) as lp:
        if args.action == "remove":
            lp.admin.delete_model(args.name)
            if args.json:
                emit({"name": args.name, "deleted": True})
            else:
                out(f"Removed model {args.name} (retired: new tasks cannot use it; the name can be registered again).")
            return 0
        if args.action == "restore":
            restored = lp.admin.restore_model(args.name)
            if args.json:
                emit(restored.raw)
            else:
                out(f"Restored model {restored.name}: new tasks can use it again.")
            return 0
        if args.action == "add":
            tenants = [_tenant_id(lp, t) for t in args.tenant] if args.tenant else None
            model = lp.admin.register_model(args.name, args.path, description=args.description, kind=args.kind,
                                            file=args.file, tenants=tenants, quantization=args.quantization)
            models, raw = [model], model.raw
        else:
            page = lp.admin.list_models(include_deleted=getattr(args, "include_deleted", False))
            models, raw = page.data, page.raw
        names = {t.id: t.name for t in _all_tenants(lp)} if any(m.tenants for m in models) else {}
    if args.json:
        emit(raw)
        return 0
    out(_models_table(models, names) if models else "No models.")
    if args.action == "add" and models[0].target_modules:
        out(f"\nLoRA target modules: {', '.join(models[0].target_modules)}")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    # The options at both levels (`admin tenants --json create x` and `admin tenants create x --json`); the
    # inner level's are SUPPRESSed so that its defaults do not overwrite what the outer level parsed.
    outer, inner = common_options(admin=True), common_options(admin=True, suppress=True)
    admin = sub.add_parser("admin", help="operator commands: tenants, API keys, workers, models (the admin token)")
    asub = admin.add_subparsers(dest="admin_command", required=True, metavar="COMMAND")

    tenants = asub.add_parser("tenants", parents=[outer], help="list tenants, or create / show / delete one")
    tenants.add_argument("--limit", type=int, default=None)
    tenants.add_argument("--after", metavar="TENANT_ID")
    tenants.add_argument("--include-deleted", action="store_true", help="list the deleted tenants too")
    tenants.set_defaults(func=guarded(cmd_tenants), client=True, action=None)
    tsub = tenants.add_subparsers(dest="action", metavar="ACTION")
    create = tsub.add_parser("create", parents=[inner], help="a new tenant (quotas default to the deployment's)")
    create.add_argument("name")
    create.add_argument("--weight", type=float, help="its share of the GPUs against other tenants (default 1)")
    create.add_argument("--max-concurrent-trials", type=int, metavar="N")
    create.add_argument("--max-trials-per-task", type=int, metavar="N")
    create.add_argument("--max-file-bytes", type=int, metavar="N")
    create.add_argument("--max-storage-bytes", type=int, metavar="N", help="bytes of live files it may store")
    create.add_argument("--max-files", type=int, metavar="N", help="live files it may store")
    show = tsub.add_parser("show", parents=[inner], help="one tenant (by id or name)")
    show.add_argument("tenant")
    tdelete = tsub.add_parser("delete", parents=[inner],
                              help="delete a tenant: revoke its keys, cancel its queued and running tasks, remove its "
                                   "webhooks (usage, finished tasks and its name are kept)")
    tdelete.add_argument("tenant", help="the tenant's id or name")

    keys = asub.add_parser("keys", parents=[outer], help="list API keys, or create / revoke one")
    keys.add_argument("--tenant", help="only this tenant's keys (id or name)")
    keys.set_defaults(func=guarded(cmd_keys), client=True, action=None)
    ksub = keys.add_subparsers(dest="action", metavar="ACTION")
    kcreate = ksub.add_parser("create", parents=[inner], help="a new key for a tenant (the secret is shown once)")
    kcreate.add_argument("tenant", help="the tenant's id or name")
    kcreate.add_argument("--name", default="", help="a label for the key")
    revoke = ksub.add_parser("revoke", parents=[inner], help="revoke a key at once")
    revoke.add_argument("key_id")

    usage = asub.add_parser("usage", parents=[outer], help="every tenant's GPU time, tokens, trials and storage")
    window_options(usage)
    usage.set_defaults(func=guarded(cmd_usage), client=True)

    workers = asub.add_parser("workers", parents=[outer], help="the GPU workers and their state")
    workers.set_defaults(func=guarded(cmd_workers), client=True)

    models = asub.add_parser("models", parents=[outer],
                             help="the base-model registry: list, add, remove or restore a model")
    models.set_defaults(func=guarded(cmd_models), client=True, action=None)
    msub = models.add_subparsers(dest="action", metavar="ACTION")
    madd = msub.add_parser("add", parents=[inner], help="register a model directory (as the workers see it)")
    madd.add_argument("name", help="its name in the registry (hub-style ids such as org/model are fine)")
    madd.add_argument("path", help="the Hugging Face model directory (config.json, *.safetensors, tokenizer)")
    madd.add_argument("--description")
    madd.add_argument("--tenant", action="append", metavar="TENANT",
                      help="a tenant (id or name) that may use it; repeat for more (default: every tenant)")
    madd.add_argument("--kind", choices=("hf", "gguf"), help="hf (default) or gguf (then give --file)")
    madd.add_argument("--file", help="the GGUF file in PATH (kind gguf)")
    madd.add_argument("--quantization", choices=("nf4",), help="nf4: workers hold its base in 4 bits (QLoRA)")
    mlist = msub.add_parser("list", parents=[inner], help="every registered model")
    mlist.add_argument("--include-deleted", action="store_true", help="the retired models too")
    mremove = msub.add_parser("remove", parents=[inner],
                              help="retire a model no queued or running task uses (finished tasks keep its name)")
    mremove.add_argument("name")
    mrestore = msub.add_parser("restore", parents=[inner],
                               help="bring a retired model back (built-in ones too); its files are checked again")
    mrestore.add_argument("name")
