namespace ExactlyOnce.Steps;

/// <summary>
/// Thrown by a step's call to say that the remote service certainly did not act (for example it answered 4xx before
/// doing anything). The step is recorded as not done, and the next attempt calls again instead of going to the policy.
/// Any other exception leaves the outcome unknown.
/// </summary>
public sealed class StepNotPerformedException : Exception
{
    /// <summary>Creates the exception.</summary>
    public StepNotPerformedException() : base("The remote service did not perform the step.") { }

    /// <summary>Creates the exception with a message.</summary>
    public StepNotPerformedException(string message) : base(message) { }

    /// <summary>Creates the exception with a message and the call's own error.</summary>
    public StepNotPerformedException(string message, Exception innerException) : base(message, innerException) { }
}

/// <summary>
/// A recorded step's outcome is unknown and its policy is <see cref="StepPolicy.Park"/>: the message was not processed
/// and is set aside (the inbox's transport integration moves it to the parked queue) until an operator resolves the step.
/// </summary>
public sealed class StepOutcomeUnknownException : Exception
{
    /// <summary>Creates the exception.</summary>
    public StepOutcomeUnknownException() : base("A recorded step's outcome is unknown; the message is parked.") { }

    /// <summary>Creates the exception with a message.</summary>
    public StepOutcomeUnknownException(string message) : base(message) { }

    /// <summary>Creates the exception with a message and an inner exception.</summary>
    public StepOutcomeUnknownException(string message, Exception innerException) : base(message, innerException) { }

    internal StepOutcomeUnknownException(StepKey step, Guid idempotencyKey, string reason) : base(reason)
    {
        Step = step;
        IdempotencyKey = idempotencyKey;
    }

    /// <summary>The parked step.</summary>
    public StepKey? Step { get; }

    /// <summary>The step's idempotency key (what the remote service may know it by).</summary>
    public Guid? IdempotencyKey { get; }
}
