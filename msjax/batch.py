"""The batch a step reads: four [batch, seq] int32 arrays under these names, in this order."""

BATCH_FIELDS = ("inputs", "targets", "positions", "segment_ids")
