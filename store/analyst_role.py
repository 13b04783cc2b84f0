"""A read-only database role for analysts: it reads the analytics views and the projection
tables, and writes nothing (no events, no projections, no tables of its own).

Privileges do the work: the role is created with no attributes (not a superuser, cannot
create roles or databases, bypasses no row security), belongs to no other role, and is
granted ``SELECT`` on the views of :data:`store.analytics.VIEWS` and the tables of
:data:`store.analytics.PROJECTION_TABLES` only: not the event log (prompts and outputs may be
sensitive), not API keys, not leases. Its sessions also start read-only
(``default_transaction_read_only``). Before committing, every relation of the schema is checked
for a write privilege the role would hold (through ``PUBLIC`` too); finding one rolls the whole
grant back.

Views added by later migrations are granted by running the grant again (it is idempotent).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import psycopg
from psycopg import sql

from store import errors
from store.analytics import PROJECTION_TABLES, VIEWS
from store.db import Database, scalar

__all__ = ["RoleGrant", "grant_read_only", "read_only_violations"]

_ROLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
_WRITE_PRIVILEGES = "INSERT, UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER"
_POWERS = ("rolsuper", "rolcreaterole", "rolcreatedb", "rolreplication", "rolbypassrls")


@dataclass(frozen=True)
class RoleGrant:
    """What :func:`grant_read_only` did: whether it created the role, whether the role can
    log in, and the relations it may read."""

    role: str
    created: bool
    login: bool
    relations: tuple[str, ...]


def _check_role_name(role: object) -> str:
    if not isinstance(role, str):
        raise TypeError(f"role must be a str, got {type(role).__name__}")
    if not _ROLE_NAME.fullmatch(role):
        raise ValueError(f"role must be 1-63 letters, digits or underscores, not starting "
                         f"with a digit; got {role!r}")
    if role.lower().startswith("pg_") or role.lower() == "public":
        raise ValueError(f"role name {role!r} is reserved by PostgreSQL")
    return role


def read_only_violations(conn: psycopg.Connection, role: str) -> list[str]:
    """What ``role`` could write in the current database: role attributes, memberships,
    write privileges on relations of the current schema, CREATE on the schema or database.
    Empty when it can write nothing. ``role`` must exist (``StoreError`` otherwise)."""
    found: list[str] = []
    attributes = conn.execute(
        f"SELECT {', '.join(_POWERS)} FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
    if attributes is None:
        raise errors.StoreError(f"role {role!r} does not exist")
    found += [name[3:].upper() for name, on in zip(_POWERS, attributes, strict=True) if on]
    found += [f"member of {r[0]}" for r in conn.execute(
        "SELECT g.rolname FROM pg_auth_members m JOIN pg_roles g ON g.oid = m.roleid"
        " JOIN pg_roles u ON u.oid = m.member WHERE u.rolname = %s", (role,))]
    found += [f"{r[1]} on {r[0]}" for r in conn.execute(
        "SELECT c.relname, p.privilege FROM pg_class c"
        " CROSS JOIN unnest(string_to_array(%s, ', ')) AS p(privilege)"
        " WHERE c.relnamespace = current_schema()::regnamespace"
        " AND c.relkind IN ('r', 'p', 'v', 'm', 'f')"
        " AND has_table_privilege(%s, c.oid, p.privilege)"
        " ORDER BY c.relname, p.privilege", (_WRITE_PRIVILEGES, role))]
    if scalar(conn, "SELECT has_schema_privilege(%s, current_schema(), 'CREATE')", (role,)):
        found.append("CREATE on schema")
    if scalar(conn, "SELECT has_database_privilege(%s, current_database(), 'CREATE')",
              (role,)):
        found.append("CREATE on database")
    return found


def grant_read_only(
    db: Database,
    *,
    role: str,
    login: bool = False,
    password: str | None = None,
) -> RoleGrant:
    """Create ``role`` (NOLOGIN unless ``login``) if it does not exist and grant it read
    access to the analytics views and projection tables of the current schema, in one
    transaction. An existing role keeps its LOGIN attribute unless ``login`` is set (then it
    gets LOGIN, and ``password`` when given).

    Raises TypeError/ValueError naming the argument for a role name that is not an
    identifier of 1-63 letters, digits and underscores or is reserved (``pg_*``, ``public``),
    for a ``password`` without ``login`` and for an empty password; ``RefusedError`` when the
    existing role (or, through ``PUBLIC``, the new one) could write something, listing what,
    and when the connected user lacks the right to create roles or grant. Nothing is changed
    when it raises.
    """
    _check_role_name(role)
    if not isinstance(login, bool):
        raise TypeError(f"login must be a bool, got {type(login).__name__}")
    if password is not None:
        if not isinstance(password, str):
            raise TypeError(f"password must be a str, got {type(password).__name__}")
        if not login:
            raise ValueError("password is only for a role that can log in (login=True)")
        if not password:
            raise ValueError("password must not be empty")
    name = sql.Identifier(role)
    login_clause: sql.Composable = sql.SQL("LOGIN" if login else "NOLOGIN")
    if password is not None:
        login_clause = sql.SQL("{} PASSWORD {}").format(login_clause, sql.Literal(password))
    relations = tuple(v.view for v in VIEWS.values()) + PROJECTION_TABLES
    with db.transaction() as conn:
        exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
        if exists is None:
            conn.execute(sql.SQL(
                "CREATE ROLE {} {} NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION"
                " NOBYPASSRLS").format(name, login_clause))
        else:
            before = read_only_violations(conn, role)
            if before:
                raise errors.RefusedError(
                    f"role {role!r} exists and can write ({'; '.join(before)}); it cannot be "
                    f"made a read-only analyst role: choose another name")
            if login:
                conn.execute(sql.SQL("ALTER ROLE {} {}").format(name, login_clause))
        conn.execute(sql.SQL("ALTER ROLE {} SET default_transaction_read_only = on")
                     .format(name))
        database = scalar(conn, "SELECT current_database()")
        schema = scalar(conn, "SELECT current_schema()")
        conn.execute(sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(
            sql.Identifier(database), name))
        conn.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(
            sql.Identifier(schema), name))
        conn.execute(sql.SQL("GRANT SELECT ON {} TO {}").format(
            sql.SQL(", ").join(sql.Identifier(r) for r in relations), name))
        after = read_only_violations(conn, role)
        if after:
            raise errors.RefusedError(
                f"role {role!r} would be able to write ({'; '.join(after)}), through "
                f"privileges granted to PUBLIC; nothing was granted")
        can_login = bool(scalar(conn, "SELECT rolcanlogin FROM pg_roles WHERE rolname = %s",
                                (role,)))
    return RoleGrant(role=role, created=exists is None, login=can_login, relations=relations)
