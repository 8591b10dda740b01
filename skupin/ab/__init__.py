"""The runtime A/B (`skupin ab`): gate both sides, measure them interleaved, decide, and write the annex. A caller of the gate."""
