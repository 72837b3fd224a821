-- The outbox quarantine: an event the broker keeps refusing is set aside instead of staying first in line.
--
-- The relay claims the oldest unsent rows. A row the broker refuses every time (a subscriber queue at its
-- length limit with reject-publish, a quorum queue without a quorum, an event over the broker's maximum
-- message size) used to stay the oldest for ever, and a batch of them meant nothing was published for
-- anybody. Now the relay counts the broker's refusals of each row (attempts, last_error): a refused row
-- waits before it is claimed again (next_attempt_at), so the rows behind it go out meanwhile, and once it
-- has been refused INTERMISSION_OUTBOX_MAX_ATTEMPTS times it is quarantined (quarantined_at): no claim
-- takes it again until an operator retries it (`intermission outbox retry`), under the same message_id.
-- Only refusals count: a broker or database outage fails every row alike and says nothing about any one.

ALTER TABLE outbox
    ADD COLUMN attempts        int NOT NULL DEFAULT 0,
    ADD COLUMN next_attempt_at timestamptz,
    ADD COLUMN quarantined_at  timestamptz,
    ADD COLUMN last_error      text;

-- The claim walks this index in id order: a quarantined row left in it would be walked past by every
-- claim, oldest first, for as long as it stays. (Rows waiting for their next attempt stay in it: they are
-- few and soon either sent or quarantined.)
DROP INDEX outbox_unsent;
CREATE INDEX outbox_unsent ON outbox (id) WHERE sent_at IS NULL AND quarantined_at IS NULL;

-- What operators list and retry, and what the metrics count.
CREATE INDEX outbox_quarantined ON outbox (id) WHERE quarantined_at IS NOT NULL;
