"""The data layer: dataset folders and records, media decoding, the dataflow loader and the DataModule."""
