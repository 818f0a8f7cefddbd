-- A cleanup takes a detached table named like inboxctl's partitions for the leftover of a drop that stopped (and
-- drops it, or attaches it again) only if it marked the table before detaching it; an earlier version took every such
-- table for one. The tables of that kind there now — left by an earlier version's stopped drop, or by a conversion
-- stopped before its swap — are marked once here, as that version would have taken them. A table with a comment of
-- its own is left alone; one this role may not comment on is said, and left.
DO $$
DECLARE
    t regclass;
BEGIN
    FOR t IN
        SELECT c.oid::regclass FROM pg_class c
        WHERE c.relname ~ '^inbox_messages_p[0-9]{8}_[0-9]{6}$' AND c.relkind = 'r' AND NOT c.relispartition
          AND c.relnamespace = (SELECT relnamespace FROM pg_class WHERE oid = to_regclass('inbox_messages'))
          AND obj_description(c.oid, 'pg_class') IS NULL
    LOOP
        BEGIN
            EXECUTE format('COMMENT ON TABLE %s IS %L', t,
                'inboxctl: detached by a cleanup, to be dropped (or attached again if it holds rows that must stay)');
        EXCEPTION WHEN insufficient_privilege THEN
            RAISE NOTICE 'table % left unmarked (this role does not own it): a cleanup run as its owner will not take it for a leftover; mark it by hand if it is one', t;
        END;
    END LOOP;
END
$$;
