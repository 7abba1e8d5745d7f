-- outbox-relay: vacuum the outbox as the queue it is.
--
-- Every relayed event leaves one dead row version behind (the mark of
-- published_at is not a HOT update: published_at is in the partial indexes'
-- predicates; the lease's HOT versions are pruned on the page). At the
-- defaults (a pass after 20 % of the table is dead, throttled by the cost
-- delay) a pass over a table holding a million-event backlog took minutes,
-- and the dead versions piled up to 720,000 during a drain (make
-- bench-backlog). Here a pass starts after 1 % (+ 5,000) and runs unthrottled:
-- the pages it has to visit are the few the drain dirtied since the last pass
-- (the visibility map skips the rest). How often the launcher looks at the
-- database is the server's autovacuum_naptime (scripts/infra-up.sh: 10 s).
ALTER TABLE outbox_events SET (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_cost_delay = 0
);
