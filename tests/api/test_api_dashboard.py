"""The dashboard is served by the API: the page at `/`, its assets under `/static/` from the package."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient

from api.routes.dashboard import STATIC_DIR


def test_the_page_is_served_at_the_root_with_a_strict_policy(client: TestClient) -> None:
    r = client.get("/")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "connect-src 'self'" in csp and "unsafe-inline" not in csp
    assert "<title>loraplane</title>" in r.text
    assert "/docs" not in client.get("/openapi.json").json()["paths"].get("/", {})  # not an API operation


def test_every_asset_the_page_and_its_modules_load_is_served(client: TestClient) -> None:
    """Follows the page's links and every module's imports: a file missing from the package shows here."""
    page = client.get("/").text
    queue = re.findall(r'(?:src|href)="(/static/[^"]+)"', page)
    assert "/static/js/app.js" in queue and "/static/style.css" in queue
    seen: set[str] = set()
    while queue:
        path = queue.pop()
        if path in seen:
            continue
        seen.add(path)
        r = client.get(path)
        assert r.status_code == 200, path
        if path.endswith(".js"):
            assert r.headers["content-type"].startswith(("text/javascript", "application/javascript")), path
            base = path.rsplit("/", 1)[0]
            for spec in re.findall(r'^\s*import\b[^;]*?from\s+"(\.{1,2}/[^"]+)"', r.text, flags=re.M | re.S):
                queue.append(_join(base, spec))
    on_disk = {"/static/" + p.relative_to(STATIC_DIR).as_posix() for p in STATIC_DIR.rglob("*") if p.is_file()}
    assert seen | {"/static/index.html"} == on_disk, "an asset nothing loads, or a load of a missing asset"


def test_the_package_ships_every_asset() -> None:
    """pyproject's package-data globs cover every file of api/static (an installed wheel serves them all)."""
    import tomllib
    from fnmatch import fnmatch

    root = STATIC_DIR.parent
    globs = tomllib.loads((root.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["api"]
    for path in STATIC_DIR.rglob("*"):
        if path.is_file():
            rel = path.relative_to(root).as_posix()
            assert any(fnmatch(rel, g) and rel.count("/") == g.count("/") for g in globs), rel


def test_static_refuses_paths_outside_the_folder(client: TestClient) -> None:
    assert client.get("/static/../main.py").status_code == 404
    assert client.get("/static/nope.js").status_code == 404


def _join(base: str, spec: str) -> str:
    parts = base.split("/")
    for piece in spec.split("/"):
        if piece == "..":
            parts.pop()
        elif piece != ".":
            parts.append(piece)
    return "/".join(parts)
