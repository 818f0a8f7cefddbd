using ExactlyOnce.Steps;

namespace ExactlyOnce.EntityFrameworkCore;

/// <summary>One row of <c>recorded_steps</c>: the journal of one external call made while processing one message for one consumer.</summary>
public sealed class RecordedStep
{
    /// <summary>The message id.</summary>
    public Guid MessageId { get; set; }

    /// <summary>The consumer's identity.</summary>
    public string ConsumerType { get; set; } = "";

    /// <summary>The step's name.</summary>
    public string StepName { get; set; } = "";

    /// <summary>The idempotency key handed to the call.</summary>
    public Guid IdempotencyKey { get; set; }

    /// <summary>Started, completed, not done or parked.</summary>
    public StepStatus Status { get; set; }

    /// <summary>The call's result as JSON, once completed.</summary>
    public string? Result { get; set; }

    /// <summary>Calls started so far (1 for the first).</summary>
    public int Attempts { get; set; }

    /// <summary>When the latest call started (UTC).</summary>
    public DateTime StartedAt { get; set; }

    /// <summary>When the step was completed or found not done (UTC).</summary>
    public DateTime? CompletedAt { get; set; }

    /// <summary>Why it is parked, or the last error of a call whose outcome is unknown.</summary>
    public string? Reason { get; set; }
}
