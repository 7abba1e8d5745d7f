-- consumer runtime: vacuum the inbox as the queue it is.
--
-- Every applied event adds an inbox row, and the cleanup deletes each a few
-- days later (8 days at the defaults): at a year's traffic tens of millions
-- of rows, a few million deleted a day. At the defaults (a pass after 20 %
-- of the table is dead) the dead rows of most of a week's deletes pile up
-- before a pass, bloating the table and its two indexes, which every
-- event's inbox insert walks. As for the outbox (orders V4): a pass after
-- 1 % (+ 5,000) of the table is dead. A catalog change, no rewrite (a brief
-- SHARE UPDATE EXCLUSIVE lock).
ALTER TABLE processed_events SET (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 5000
);
