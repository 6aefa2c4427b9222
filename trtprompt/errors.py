"""Errors a user can fix: the CLI prints their message alone and exits non-zero."""

from __future__ import annotations


class UserError(ValueError):
    """Bad input (checkpoint, profile, bounds, engine dir); the message says what and why."""


class CheckpointError(UserError):
    pass


class ProfileError(UserError):
    pass


class PlanError(UserError):
    pass


class EngineDirError(UserError):
    pass


class TargetUnavailableError(UserError):
    pass
