"""The role the API and the workers should connect as: it owns nothing.

The event log's immutability rests on triggers that refuse UPDATE, DELETE and TRUNCATE. A role
that owns the ``events`` table can switch them off (``ALTER TABLE … DISABLE TRIGGER``), and a
superuser can bypass them for a session (``SET session_replication_role = replica``). The role
made here has neither power: it is created with no attributes (not a superuser, cannot create
roles or databases, no replication, no row-security bypass), owns no relation, and holds only
what the processes use:

- ``events``: ``SELECT`` and ``INSERT`` (never ``UPDATE``, ``DELETE`` or ``TRUNCATE``);
- every other table of the schema (projections, leases, API keys, follower cursors): ``SELECT,
  INSERT, UPDATE, DELETE`` (projections are rebuilt; ``alembic_version``: ``SELECT`` only);
- ``USAGE`` on the schema and its sequences, ``CONNECT`` on the database.

Migrations stay with the owner (``trajstore migrate`` as the role that owns the tables); run
the grant again after a migration adds tables (it is idempotent). What holds for the app role
is checked before committing (``app_role_violations``); finding anything rolls it back.
"""

from __future__ import annotations

from dataclasses import dataclass

from psycopg import sql

from store import errors
from store.analyst_role import _check_role_name
from store.db import Database, scalar

__all__ = ["AppRoleGrant", "app_role_violations", "grant_app_role"]

_POWERS = ("rolsuper", "rolcreaterole", "rolcreatedb", "rolreplication", "rolbypassrls")
_READ_ONLY = ("alembic_version",)


@dataclass(frozen=True)
class AppRoleGrant:
    """What :func:`grant_app_role` did: whether it created the role, and the tables granted."""

    role: str
    created: bool
    tables: tuple[str, ...]


def app_role_violations(conn: object, role: str) -> list[str]:
    """What ``role`` could do beyond the app's needs in the current database: role
    attributes, memberships, ownership of any relation, and any write on ``events`` beyond
    INSERT. Empty when there is nothing."""
    found: list[str] = []
    row = conn.execute(  # type: ignore[attr-defined]
        f"SELECT {', '.join(_POWERS)} FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
    if row is None:
        raise errors.StoreError(f"no role {role!r}")
    found += [f"role attribute {name}" for name, on in zip(_POWERS, row, strict=True) if on]
    found += [f"member of {r[0]}" for r in conn.execute(  # type: ignore[attr-defined]
        "SELECT g.rolname FROM pg_auth_members m JOIN pg_roles g ON g.oid = m.roleid"
        " JOIN pg_roles u ON u.oid = m.member WHERE u.rolname = %s", (role,)).fetchall()]
    found += [f"owns {r[0]}" for r in conn.execute(  # type: ignore[attr-defined]
        "SELECT c.relname FROM pg_class c JOIN pg_roles o ON o.oid = c.relowner"
        " WHERE o.rolname = %s", (role,)).fetchall()]
    for privilege in ("UPDATE", "DELETE", "TRUNCATE", "TRIGGER", "REFERENCES"):
        if conn.execute("SELECT has_table_privilege(%s, 'events', %s)",  # type: ignore[attr-defined]
                        (role, privilege)).fetchone()[0]:
            found.append(f"{privilege} on events")
    return found


def grant_app_role(db: Database, role: str, *, password: str | None = None) -> AppRoleGrant:
    """Create ``role`` (LOGIN, with ``password`` when given) unless it exists, and grant it
    what the app needs (module docstring), in one transaction. Raises ValueError for a bad
    role name, ``StoreError`` when the role would hold more than that (nothing is kept)."""
    role = _check_role_name(role)
    name = sql.Identifier(role)
    with db.transaction() as conn:
        exists = scalar(conn, "SELECT count(*) FROM pg_roles WHERE rolname = %s", (role,))
        if not exists:
            conn.execute(sql.SQL(
                "CREATE ROLE {} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION"
                " NOBYPASSRLS").format(name))
        if password is not None:
            conn.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(name,
                                                                     sql.Literal(password)))
        database = scalar(conn, "SELECT current_database()")
        conn.execute(sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(
            sql.Identifier(str(database)), name))
        conn.execute(sql.SQL("GRANT USAGE ON SCHEMA public TO {}").format(name))
        tables = [r[0] for r in conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1")]
        for table in tables:
            privileges = ("SELECT, INSERT" if table == "events" else
                          "SELECT" if table in _READ_ONLY else "SELECT, INSERT, UPDATE, DELETE")
            conn.execute(sql.SQL("GRANT " + privileges + " ON {} TO {}").format(
                sql.Identifier(table), name))
        conn.execute(sql.SQL("GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {}")
                     .format(name))
        violations = app_role_violations(conn, role)
        if violations:
            raise errors.StoreError(f"role {role!r} would hold more than the app needs: "
                                    + "; ".join(violations))
    return AppRoleGrant(role=role, created=not exists, tables=tuple(tables))
