"""``python -m dropless train | generate``: the ``dropless`` command."""

from dropless.cli import main

raise SystemExit(main())
