"""tqdm progress bars on stderr, or a silent stand-in when progress display is off."""

from __future__ import annotations

import sys
from typing import Any

from tqdm.auto import tqdm


class NoBar:
    """The progress-bar interface the trainer and the evaluator use, doing nothing."""

    def update(self, n: int = 1) -> None: ...
    def set_postfix(self, *args: Any, **kwargs: Any) -> None: ...
    def set_postfix_str(self, *args: Any, **kwargs: Any) -> None: ...
    def set_description(self, *args: Any, **kwargs: Any) -> None: ...
    def close(self) -> None: ...


def progress_bar(*, total: int, desc: str, enabled: bool, initial: int = 0, leave: bool = True) -> Any:
    if not enabled:
        return NoBar()
    return tqdm(total=total, desc=desc, initial=initial, leave=leave, dynamic_ncols=True, file=sys.stderr)
