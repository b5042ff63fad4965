"""The results pages of the docs, one module a page (each a `page()` building its `Page` and its
tables, read from the JSONs in `results/` that the command beside each table wrote), and the
README's headline table, each headline beside the page it links to. Row builders that several pages
share are in `rows.py`. Rendered by `prescient report` (the engine, `experiments/report.py`)."""

from __future__ import annotations

from experiments.report_pages import (architectures, batch, caches, compressed, demo, hybrid, memory, predictors,
                                      reference, replicas, runtime, serving)
from experiments.report_tables import Headline, Page

PAGES: tuple[Page, ...] = (reference.page(), demo.page(), predictors.page(), caches.page(), runtime.page(),
                           hybrid.page(), memory.page(), compressed.page(), serving.page(), replicas.page(),
                           batch.page(), architectures.page())
HEADLINES: tuple[Headline, ...] = (memory.HEADLINES + predictors.HEADLINES + runtime.HEADLINES + compressed.HEADLINES
                                   + serving.HEADLINES + batch.HEADLINES + architectures.HEADLINES)
