"""Subcommands of ``vip``. Each module defines ``register(subparsers)``; heavy imports stay inside handlers."""
