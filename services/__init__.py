"""pdserve's services. Importing engine first sets torch's allocator up (see engine/__init__.py)."""

import engine  # noqa: F401
