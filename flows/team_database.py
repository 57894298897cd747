"""PostgreSQL under ``sim2edge up``: one server, a database each for MLflow and Prefect.

``--database postgresql://USER[:PASSWORD]@HOST[:PORT]/NAME`` names the server and a base name: MLflow's tracking
store goes in ``NAME_mlflow`` (through psycopg2), Prefect's in ``NAME_prefect`` (through asyncpg; the two cannot
share one database, both keep an ``alembic_version`` table), and with ``--auth`` MLflow's users in ``NAME_auth``. Before anything starts, the server is checked: it must
answer, be PostgreSQL 14 or newer (Prefect 3's floor), and hold both databases, which are created when the user may
(``CREATEDB``); each server then applies its own migrations at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

MIN_SERVER_VERSION = 140000
"""``server_version_num`` of PostgreSQL 14."""


class DatabaseError(RuntimeError):
    """The database of ``--database`` cannot be used; one line saying which check failed."""


@dataclass(frozen=True)
class TeamDatabase:
    """The connection URLs derived from ``--database``, and the form printed (password hidden)."""

    mlflow_url: str
    prefect_url: str
    auth_url: str
    shown: str


def parse(url: str) -> TeamDatabase:
    """``postgresql://USER[:PASSWORD]@HOST[:PORT]/NAME`` as the MLflow and Prefect URLs; DatabaseError otherwise."""
    parts = urlsplit(url)
    name = parts.path.lstrip("/")
    if parts.scheme not in ("postgresql", "postgres") or not parts.hostname or not parts.username:
        raise DatabaseError(f"--database {url!r}: expected postgresql://USER[:PASSWORD]@HOST[:PORT]/NAME")
    if not name or not name.replace("_", "").isalnum() or parts.query or parts.fragment:
        raise DatabaseError(f"--database: base name {name!r} must be letters, digits and _ (no query)")
    try:
        parts.port
    except ValueError:
        raise DatabaseError(f"--database {url!r}: the port is not a number") from None

    def at(scheme: str, suffix: str) -> str:
        return urlunsplit((scheme, parts.netloc, f"/{name}_{suffix}", "", ""))

    shown = urlunsplit(("postgresql", parts.netloc.replace(f":{parts.password}@", ":***@") if parts.password
                        else parts.netloc, f"/{name}", "", ""))
    return TeamDatabase(at("postgresql+psycopg2", "mlflow"), at("postgresql+asyncpg", "prefect"),
                        at("postgresql+psycopg2", "auth"), shown)


def prepare(db: TeamDatabase, auth: bool = False, timeout_s: float = 10) -> None:
    """Check the server (reachable, version) and create the databases (the auth one with ``auth``) where missing."""
    import psycopg2
    from psycopg2 import sql

    parts = urlsplit(db.mlflow_url)
    try:
        conn = psycopg2.connect(host=parts.hostname, port=parts.port or 5432, user=parts.username,
                                password=parts.password, dbname="postgres", connect_timeout=int(timeout_s))
    except psycopg2.OperationalError as e:
        raise DatabaseError(f"--database {db.shown}: cannot connect ({' '.join(str(e).split())})") from None
    try:
        conn.autocommit = True  # CREATE DATABASE cannot run in a transaction
        with conn.cursor() as cur:
            if conn.server_version < MIN_SERVER_VERSION:
                raise DatabaseError(f"--database {db.shown}: PostgreSQL {conn.server_version // 10000} is too old; "
                                    f"Prefect needs 14 or newer")
            for url in (db.mlflow_url, db.prefect_url, *([db.auth_url] if auth else [])):
                name = urlsplit(url).path.lstrip("/")
                cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
                if cur.fetchone() is None:
                    try:
                        cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
                    except psycopg2.Error as e:
                        raise DatabaseError(f"--database {db.shown}: database {name} is missing and cannot be "
                                            f"created ({e.pgerror.strip() if e.pgerror else e}); "
                                            f"ask for it: createdb {name}") from None
    finally:
        conn.close()
