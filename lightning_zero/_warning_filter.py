"""A warnings filter that lives as long as a run: added at set-up, removed at teardown, the user's own filters (added
before or meanwhile) left as they are."""

from __future__ import annotations

import warnings


class RunFilter:
    """Ignore warnings of ``category`` whose message matches ``message`` (a regular expression) between :meth:`add`
    and :meth:`remove`."""

    def __init__(self, message: str, category: type[Warning]) -> None:
        self.message, self.category = message, category
        self._entry: tuple[object, ...] | None = None  # the filter as `warnings.filters` holds it, while added

    def add(self) -> None:
        if self._entry is None:
            warnings.filterwarnings("ignore", message=self.message, category=self.category)
            self._entry = warnings.filters[0]

    def remove(self) -> None:
        if self._entry is None:
            return
        if self._entry in warnings.filters:
            warnings.filters.remove(self._entry)
            # what `filterwarnings` does after changing the list: warnings already seen are looked up again
            mutated = getattr(warnings, "_filters_mutated", None)
            if mutated is not None:
                mutated()
        self._entry = None
