"""Readers of the samples for the SLA report: the SampleReader interface (base), the raw samples
(raw.RawReader), per-run rollups (rollup.RollupReader) and both added up (merged.MergedReader);
merged.reader_for picks the reader of a report. This package module imports nothing, so
analysis.rollup (the build) can use raw.RawReader without a cycle through merged."""
