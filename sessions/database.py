"""The metadata database as the admin commands manage it (`chatkv db`): opening it, its migration
revision and the upgrade to the newest one (a manager also upgrades at start-up). These are the
storage layer's own functions, handed to the faces here so that `app/` needs no door but `sessions`.
"""

from __future__ import annotations

from storage.database import current_revision as database_revision
from storage.database import head_revision, open_database
from storage.database import upgrade as upgrade_database

__all__ = ["database_revision", "head_revision", "open_database", "upgrade_database"]
