-- outbox-relay: no planner statistics of the columns no query filters,
-- joins or sorts on.
--
-- The outbox is analyzed often (every tenth of it changed: a drain of a
-- backlog triggers several passes), and ANALYZE computes statistics of every
-- column from 30,000 sampled rows. For the payload that means sorting 30,000
-- jsonb documents with jsonb_cmp: in a profile of a one-relay drain, ANALYZE
-- of the outbox was 5 % of the whole machine's CPU (its sorts 3 %), and on a
-- copy of 100,000 bench rows one ANALYZE took 0.87-1.05 s with these
-- statistics and 0.19-0.23 s without (BENCHMARKS.md, session 15). The relay,
-- replay, cleanup and the gauges never name these columns in a condition.
-- A catalog change under SHARE UPDATE EXCLUSIVE: inserts and the relay's
-- updates go on meanwhile.
ALTER TABLE outbox_events
    ALTER COLUMN payload SET STATISTICS 0,
    ALTER COLUMN traceparent SET STATISTICS 0,
    ALTER COLUMN tracestate SET STATISTICS 0,
    ALTER COLUMN last_error SET STATISTICS 0;
