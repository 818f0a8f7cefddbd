namespace ExactlyOnce.Tests;

// Every inbox guarantee test again, with the inbox in batched mode (ExactlyOnceOptions.Batching.Enabled). The
// behaviour each one asserts is the contract of both modes; only the mechanism underneath differs.

/// <summary><see cref="InboxGuaranteeTests"/> in batched mode.</summary>
public sealed class BatchedInboxGuaranteeTests : InboxGuaranteeTests
{
    protected override bool Batched => true;
}

/// <summary><see cref="ConcurrencyTests"/> in batched mode: copies of one id in one batch, across batches and across buses.</summary>
public sealed class BatchedConcurrencyTests : ConcurrencyTests
{
    protected override bool Batched => true;
}

/// <summary><see cref="CrashTests"/> in batched mode: the child process commits a batch, then is killed before acknowledging.</summary>
public sealed class BatchedCrashTests : CrashTests
{
    protected override bool Batched => true;
}

/// <summary><see cref="TrapTests"/> in batched mode.</summary>
public sealed class BatchedTrapTests : TrapTests
{
    protected override bool Batched => true;
}

/// <summary><see cref="BadInputTests"/> in batched mode.</summary>
public sealed class BatchedBadInputTests : BadInputTests
{
    protected override bool Batched => true;
}

/// <summary><see cref="MissingInboxTableTests"/> in batched mode: the batch's claim statement reports the missing migration.</summary>
public sealed class BatchedMissingInboxTableTests : MissingInboxTableTests
{
    protected override bool Batched => true;
}

/// <summary><see cref="InboxPropertyTests"/> in batched mode: concurrent waves form batches with failures and copies inside.</summary>
public sealed class BatchedInboxPropertyTests : InboxPropertyTests
{
    protected override bool Batched => true;
}

/// <summary><see cref="TelemetryTests"/> in batched mode: outcomes are still counted, timed and traced per message.</summary>
public sealed class BatchedTelemetryTests : TelemetryTests
{
    protected override bool Batched => true;
}

/// <summary><see cref="SqliteInboxTests"/> in batched mode: the SQLite store's batch path.</summary>
public sealed class BatchedSqliteInboxTests : SqliteInboxTests
{
    protected override bool Batched => true;
}
