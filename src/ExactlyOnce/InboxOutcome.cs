namespace ExactlyOnce;

/// <summary>What the inbox did with one delivery.</summary>
public enum InboxOutcome
{
    /// <summary>The consumer ran and its effects were committed together with the inbox row.</summary>
    Processed,

    /// <summary>A committed claim already existed: the consumer did not run and the delivery was acknowledged.</summary>
    Duplicate,

    /// <summary>The consumer or the commit failed: nothing was committed and the message remains to be retried.</summary>
    Failed,

    /// <summary>Another delivery of the same key held the claim longer than the claim timeout: retried later.</summary>
    Deferred,

    /// <summary>A recorded step's outcome was unknown and its policy parked the message: rolled back and set aside for an operator.</summary>
    Parked,
}
